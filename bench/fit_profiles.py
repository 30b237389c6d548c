"""Fit the generator's shipped parameters from the real routing data and write them into the package.

    python bench/fit_profiles.py [--traces ../shared/traces] [--out operator/moe_eplb/eplb/workload/profiles/profiles.json]
    python bench/fit_profiles.py --check      # fit again and fail if the shipped file differs

Reads the ``expert_counts_by_domain`` files (OLMoE base / SFT, Mixtral, and DeepSeek-V3's six
SGLang regimes over all 58 MoE layers) and the ``token_routing_sequence`` files
(Mixtral-8x7B-Instruct on GSM8K and HumanEval), fits :class:`moe_eplb.eplb.workload.profiles.PopularityFit`
(for DeepSeek-V3 with its 8 expert groups, fitted on the static placement over 32 GPUs) and
:class:`~moe_eplb.eplb.workload.profiles.TemporalFit` (see docs/traces.md for the method), prints what was
fitted -- for DeepSeek-V3 the real and the generated busiest-GPU/mean and hottest-expert/mean
(:func:`moe_eplb.eplb.workload.profiles.static_imbalance`) -- and writes only the fitted numbers (not the
data) to the packaged JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from moe_eplb.eplb.workload import profiles, synth, tracefile

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = ROOT.parent / "shared" / "traces"
DEFAULT_OUT = ROOT / "operator" / "moe_eplb" / "eplb" / "workload" / "profiles" / profiles.FIT_FILE

POPULARITY_FILES = {
    "olmoe": "olmoe_expert_counts.json",
    "olmoe-sft": "olmoe_sft_expert_counts.json",
    "mixtral": "mistral_expert_counts.json",
    "deepseek-v3": "deepseek_v3_expert_counts.json",
}
# fits with expert groups: name -> (groups, EP size of the static placement fitted on, decimals
# shipped). DeepSeek-V3 has 8 groups of 32 experts; 3 decimals keep its 58 layers compact.
GROUPED = {"deepseek-v3": (8, 32, 3)}
ROUTING_FILES = ("mixtral_gsm8k_token_routing.json", "mixtral_humaneval_token_routing.json")


def fit_all(traces: Path) -> dict:
    out: dict = {"format_version": profiles.FIT_FORMAT_VERSION, "popularity": {}, "sources": {}}
    for name, fname in POPULARITY_FILES.items():
        path = traces / fname
        counts = tracefile.read_routing_file(path)
        if name in GROUPED:
            groups, ep, digits = GROUPED[name]
            fit = profiles.fit_popularity(counts, num_groups=groups, ep_size=ep, digits=digits)
            out["popularity"][name] = fit.to_dict(digits=digits)
        else:
            out["popularity"][name] = profiles.fit_popularity(counts).to_dict()
        out["sources"][name] = fname
    routings = [tracefile.read_routing_file(traces / f) for f in ROUTING_FILES]
    mixtral = profiles.PopularityFit.from_dict(out["popularity"]["mixtral"])  # same model as the routings
    out["temporal"] = profiles.fit_temporal(routings, same_model_popularity=mixtral).to_dict()
    out["sources"]["temporal"] = list(ROUTING_FILES)
    return out


def show(fits: dict, traces: Path) -> None:
    print(f"{'fit':<12} {'domain':<22} {'layer depth':<18} {'max/mean':<22} {'TV to other domains'}")
    for name, raw in fits["popularity"].items():
        fit = profiles.PopularityFit.from_dict(raw)
        for di, d in enumerate(fit.domains):
            others = np.arange(len(fit.domains)) != di
            if len(fit.depth) > 4:  # every layer: summarise
                tv = fit.tv[:, di][:, others].max(axis=1) if len(fit.domains) > 1 else np.zeros(1)
                print(f"{name:<12} {d:<22} {len(fit.depth)} layers{'':<9} "
                      f"{fit.max_over_mean[d].min():.2f}-{fit.max_over_mean[d].max():<17.2f} max {tv.min():.2f}-{tv.max():.2f}")
                continue
            tvs = [f"{fit.tv[k, di][others].max():.2f}" if len(fit.domains) > 1 else "-" for k in range(len(fit.depth))]
            print(
                f"{name:<12} {d:<22} {' '.join(f'{x:.2f}' for x in fit.depth):<18} "
                f"{' '.join(f'{x:.2f}' for x in fit.max_over_mean[d]):<22} max {' '.join(tvs)}"
            )
    for name, (groups, ep, _digits) in GROUPED.items():
        fit = profiles.PopularityFit.from_dict(fits["popularity"][name])
        counts = tracefile.read_routing_file(traces / POPULARITY_FILES[name])
        layout = synth.domain_popularity(fit, len(fit.depth), fit.num_experts, seed=0, num_groups=groups)
        print(f"{name}: static placement on {ep} GPUs, median over layers (real -> generated layout, seed 0);"
              f" group loading a^2 per domain")
        for di, d in enumerate(fit.domains):
            real = profiles.static_imbalance(counts.popularity(d), ep)
            gen = profiles.static_imbalance(layout[di], ep)
            print(f"  {d:<22} busiest GPU/mean {real.busiest_gpu:.2f} -> {gen.busiest_gpu:.2f}   "
                  f"hottest expert/mean {real.hottest_expert:.2f} -> {gen.hottest_expert:.2f}   "
                  f"a^2 {fit.group_loading[di]:.3f}")
    t = fits["temporal"]
    print(
        f"temporal ({t['source']}): kappa {t['kappa']:.1f} (E={t['num_experts']}), lag-1 autocorrelation "
        f"{t['lag1']:.3f}, mean request {t['mean_request_tokens']:.0f} tokens, dispersion {t['dispersion']}"
    )
    print(
        f"request vs domain spread (Mixtral): one request lies TV {t['request_tv']:.3f} from the mean, "
        f"two domains TV {t['domain_tv']:.3f} apart: ratio {t['request_tv'] / t['domain_tv']:.2f}"
    )


def dumps(obj) -> str:
    """JSON with one key per line and every list of numbers on one line (compact and diffable)."""

    def flat(x) -> bool:
        return isinstance(x, list) and all(isinstance(v, (int, float)) for v in x)

    def enc(x, indent: int) -> str:
        pad = " " * (indent + 1)
        if isinstance(x, dict):
            items = [f"{pad}{json.dumps(k)}: {enc(v, indent + 1)}" for k, v in x.items()]
            return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}" if items else "{}"
        if isinstance(x, list) and x and not flat(x):
            return "[\n" + ",\n".join(pad + enc(v, indent + 1) for v in x) + "\n" + " " * indent + "]"
        return json.dumps(x, separators=(",", ":")) if flat(x) else json.dumps(x)

    return enc(obj, 0) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing")
    args = ap.parse_args(argv)
    if not args.traces.is_dir():
        print(f"no routing data at {args.traces}; pass --traces DIR", file=sys.stderr)
        return 2
    fits = fit_all(args.traces)
    show(fits, args.traces)
    text = dumps(fits)
    if args.check:
        same = args.out.exists() and json.loads(args.out.read_text()) == json.loads(text)
        print("shipped fit is up to date" if same else f"{args.out} differs from a fresh fit; re-run without --check")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
