"""Fit the generator's shipped parameters from the real routing data and write them into the package.

    python bench/fit_profiles.py [--traces ../shared/traces] [--out operator/moe_eplb/eplb/profiles.json]
    python bench/fit_profiles.py --check      # fit again and fail if the shipped file differs

Reads the ``expert_counts_by_domain`` files (OLMoE base / SFT, Mixtral) and the
``token_routing_sequence`` files (Mixtral-8x7B-Instruct on GSM8K and HumanEval), fits
:class:`moe_eplb.eplb.profiles.PopularityFit` and :class:`~moe_eplb.eplb.profiles.TemporalFit`
(see docs/traces.md for the method), prints what was fitted, and writes only the fitted numbers
(not the data) to the packaged JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from moe_eplb.eplb import profiles, tracefile

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = ROOT.parent / "shared" / "traces"
DEFAULT_OUT = ROOT / "operator" / "moe_eplb" / "eplb" / profiles.FIT_FILE

POPULARITY_FILES = {
    "olmoe": "olmoe_expert_counts.json",
    "olmoe-sft": "olmoe_sft_expert_counts.json",
    "mixtral": "mistral_expert_counts.json",
}
ROUTING_FILES = ("mixtral_gsm8k_token_routing.json", "mixtral_humaneval_token_routing.json")


def fit_all(traces: Path) -> dict:
    out: dict = {"format_version": profiles.FIT_FORMAT_VERSION, "popularity": {}, "sources": {}}
    for name, fname in POPULARITY_FILES.items():
        path = traces / fname
        counts = tracefile.read_routing_file(path)
        out["popularity"][name] = profiles.fit_popularity(counts).to_dict()
        out["sources"][name] = fname
    routings = [tracefile.read_routing_file(traces / f) for f in ROUTING_FILES]
    mixtral = profiles.PopularityFit.from_dict(out["popularity"]["mixtral"])  # same model as the routings
    out["temporal"] = profiles.fit_temporal(routings, same_model_popularity=mixtral).to_dict()
    out["sources"]["temporal"] = list(ROUTING_FILES)
    return out


def show(fits: dict) -> None:
    print(f"{'fit':<10} {'domain':<10} {'layer depth':<18} {'max/mean':<22} {'TV to other domains'}")
    for name, raw in fits["popularity"].items():
        fit = profiles.PopularityFit.from_dict(raw)
        for di, d in enumerate(fit.domains):
            tvs = [f"{fit.tv[k, di][np.arange(len(fit.domains)) != di].max():.2f}" if len(fit.domains) > 1 else "-" for k in range(len(fit.depth))]
            print(
                f"{name:<10} {d:<10} {' '.join(f'{x:.2f}' for x in fit.depth):<18} "
                f"{' '.join(f'{x:.2f}' for x in fit.max_over_mean[d]):<22} max {' '.join(tvs)}"
            )
    t = fits["temporal"]
    print(
        f"temporal ({t['source']}): kappa {t['kappa']:.1f} (E={t['num_experts']}), lag-1 autocorrelation "
        f"{t['lag1']:.3f}, mean request {t['mean_request_tokens']:.0f} tokens, dispersion {t['dispersion']}"
    )
    print(
        f"request vs domain spread (Mixtral): one request lies TV {t['request_tv']:.3f} from the mean, "
        f"two domains TV {t['domain_tv']:.3f} apart: ratio {t['request_tv'] / t['domain_tv']:.2f}"
    )


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
    show(fits)
    text = json.dumps(fits, indent=1, sort_keys=False) + "\n"
    if args.check:
        same = args.out.exists() and json.loads(args.out.read_text()) == json.loads(text)
        print("shipped fit is up to date" if same else f"{args.out} differs from a fresh fit; re-run without --check")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
