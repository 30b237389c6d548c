"""Readers and fits on the real routing data in ../shared/traces (skipped when it is absent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_eplb.eplb.workload import profiles, tracefile
from moe_eplb.eplb.workload.trace import TraceError

ROOT = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("MOE_EPLB_SHARED_TRACES", ROOT.parent / "shared" / "traces"))

pytestmark = [
    pytest.mark.traces,
    pytest.mark.skipif(not TRACES.is_dir(), reason=f"real routing data not found at {TRACES} (set MOE_EPLB_SHARED_TRACES)"),
]


def test_olmoe_counts_reader_and_published_facts():
    counts = tracefile.read_routing_file(TRACES / "olmoe_expert_counts.json")
    assert isinstance(counts, tracefile.DomainCounts)
    assert counts.domains == ("arxiv", "book", "c4", "github", "tulu", "wikipedia")
    assert counts.layers == (0, 7, 15) and counts.num_experts == 64 and counts.top_k == 8
    for d in counts.domains:
        assert counts.counts[d].shape == (3, 64)
        np.testing.assert_allclose(counts.popularity(d).sum(axis=1), 1.0)
    fit = profiles.fit_popularity(counts)
    mm = np.concatenate(list(fit.max_over_mean.values()))
    assert 2.49 < mm.min() < 2.51 and 7.80 < mm.max() < 7.82  # README: 2.5-7.8
    upper = np.triu_indices(6, 1)
    tv = np.stack([fit.tv[k][upper] for k in (1, 2)])  # layers 7 and 15
    assert 0.20 < tv.min() < 0.21 and 0.70 < tv.max() < 0.71  # README: 0.21-0.70
    # the curve keeps the exact extremes
    np.testing.assert_allclose(np.exp(fit.log_quantiles["arxiv"][0, -1]), fit.max_over_mean["arxiv"][0])


def test_mixtral_counts_and_sft_counts():
    mix = tracefile.read_routing_file(TRACES / "mistral_expert_counts.json")
    assert mix.num_experts == 8 and mix.top_k == 2 and mix.layers == (0, 15, 31) and "tulu" not in mix.domains
    sft = tracefile.read_routing_file(TRACES / "olmoe_sft_expert_counts.json")
    assert sft.domains == ("tulu",)
    base = tracefile.read_routing_file(TRACES / "olmoe_expert_counts.json")
    # fine-tuning hardly moves the chat popularity: the base model's tulu stands in for chat
    tv = profiles.total_variation(base.popularity("tulu"), sft.popularity("tulu"))
    assert np.all(tv < 0.1)


def test_token_routing_reader_and_trace():
    r = tracefile.read_routing_file(TRACES / "mixtral_gsm8k_token_routing.json")
    assert isinstance(r, tracefile.TokenRouting)
    assert r.choices.shape == (247, 32, 2) and r.num_experts == 8
    assert (r.choices == -1).all(axis=2).sum() == 15  # the file's empty entries
    assert set(np.unique(r.sequence_id)) == {0, 1}
    hot = r.onehot()
    assert hot.sum() == 2 * (247 * 32 - 15)
    trace = r.to_trace(tokens_per_bucket=10)
    assert trace.load.shape == (24, 32, 8) and trace.top_k == 2
    np.testing.assert_array_equal(trace.bucket_steps, 10)
    np.testing.assert_array_equal(trace.load, hot[:240].reshape(24, 10, 32, 8).sum(1))
    with pytest.raises(TraceError, match="tokens_per_bucket"):
        r.to_trace(tokens_per_bucket=1000)


def test_temporal_fit_on_both_generations():
    routings = [tracefile.read_routing_file(TRACES / f) for f in ("mixtral_gsm8k_token_routing.json", "mixtral_humaneval_token_routing.json")]
    t = profiles.fit_temporal(routings)
    # variance of windowed counts grows with the window: requests have their own preferences
    assert t.dispersion[64] > t.dispersion[8] > 1.0
    assert 10 < t.kappa < 1000
    assert 0.05 < t.lag1 < 0.3  # neighbouring tokens share experts more than chance
    assert t.mean_request_tokens == pytest.approx((168 + 79 + 83 + 255) / 4)
    assert t.request_tv is not None and t.domain_tv is None  # no expert counts given
    mixtral = profiles.fit_popularity(tracefile.read_routing_file(TRACES / "mistral_expert_counts.json"))
    t = profiles.fit_temporal(routings, same_model_popularity=mixtral)
    # one request strays further from the mean than one text domain from another
    assert 0.08 < t.request_tv < 0.12 and 0.04 < t.domain_tv < 0.06
    assert 1.3 < t.request_to_domain_tv < 2.5
    # the Dirichlet TV helpers invert each other
    p = np.array([0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.03, 0.02])
    assert profiles.dirichlet_tv(p, profiles.kappa_for_tv(p, 0.1)) == pytest.approx(0.1)


@pytest.mark.integration
def test_shipped_fit_matches_a_fresh_fit():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fit_profiles.py"), "--traces", str(TRACES), "--check"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "shipped fit is up to date" in out.stdout


def test_bad_routing_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"kind": "something"}))
    with pytest.raises(TraceError, match="kind is 'something'"):
        tracefile.read_routing_file(p)
    d = json.loads((TRACES / "olmoe_sft_expert_counts.json").read_text())
    d["counts"]["tulu"] = d["counts"]["tulu"][:2]
    with pytest.raises(TraceError, match=r"counts\.tulu: shape \(2, 64\), expected \(3, 64\)"):
        tracefile.domain_counts_from_dict(d)
    d = json.loads((TRACES / "mixtral_gsm8k_token_routing.json").read_text())
    d["experts"][3][5] = [1, 9]
    with pytest.raises(TraceError, match=r"experts\[3\]\[5\] = \[1, 9\] is not 2 expert ids < 8"):
        tracefile.token_routing_from_dict(d)
