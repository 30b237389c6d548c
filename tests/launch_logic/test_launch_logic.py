"""vLLM's launch logic as a test tier: every example, every golden and a grid of layouts, rendered,
run through Kubernetes' ``$(VAR)`` expansion and the pods' own ``sh -c`` scripts, then through each
release's own ``vllm serve`` parser, ``validate_parsed_serve_args``, serve-path choice and
``create_engine_config`` up to its ``ParallelConfig`` (tests/launch_logic/vllm_launcher.py), for every
release in range: the installed CPU wheel (0.32) and the Python sources of 0.33 and 0.34.

Asserted (tests/launch_logic/expect.py): the outcome the operator intends
(:mod:`moe_eplb.api.layout`) -- the LB mode, which ranks each API server dispatches to, the number of
API servers, the engines each pod starts, every rank of the group served -- and that every API
server is reachable through the rendered Service, container ports and PodMonitor.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from moe_eplb.api.spec import OperatorDefaults
from moe_eplb.api.validation import check_for_operator
from moe_eplb.api.versions import format_version, parse_version
from moe_eplb.api.wide_ep import FT_SCALE_DOWN_SINCE
from moe_eplb.render.objects import render_children
from tests.example_manifests import EXAMPLES, load_moeinferences, set_path
from tests.launch_logic.expect import launch_group, problems
from tests.launch_logic.pods import joiners_of, request, run_shell

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))
PROM = OperatorDefaults(prometheus_url="http://prometheus.monitoring:9090")


def render(resource: dict[str, Any]) -> list[dict[str, Any]]:
    """The children ``moe-eplb render`` prints for a resource it accepts (failing the test otherwise)."""
    checked = check_for_operator(resource, PROM)
    assert checked.problems == [], [str(p) for p in checked.problems]
    return render_children(checked.inference)


def _skip_newer(version, launcher) -> None:
    """A manifest that asks for a newer vLLM than the release is not that release's to launch (it may
    use a choice the release does not have yet, e.g. ``mori`` before 0.34)."""
    release = parse_version(launcher.release)
    if version is not None and release is not None and tuple(version[:2]) > tuple(release[:2]):
        pytest.skip(f"asks for vLLM {format_version(version)}, newer than {launcher.release}")


def _assert_launches(children, launcher):
    out = launch_group(children, launcher)
    assert problems(children, out) == [], "\n".join(problems(children, out))
    return out


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_launch_logic_every_example_launches_as_meant(vllm_release, example):
    for resource in load_moeinferences(example):
        children = render(resource)
        _skip_newer(check_for_operator(resource, PROM).inference.engine.version, vllm_release)
        _assert_launches(children, vllm_release)


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("render-*.yaml")), ids=lambda p: p.stem)
def test_launch_logic_every_golden_launches_as_meant(vllm_release, golden):
    children = [d for d in yaml.safe_load_all(golden.read_text()) if d]
    workload = next(c for c in children if c["kind"] in ("Deployment", "LeaderWorkerSet"))
    template = workload["spec"].get("template") or workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    _skip_newer(parse_version(template["spec"]["containers"][0]["image"].rsplit(":", 1)[-1]), vllm_release)
    _assert_launches(children, vllm_release)


def test_launch_logic_the_multinode_leader_dispatches_to_every_rank_of_its_group(vllm_release):
    """examples/deepseek-v3-multinode.yaml (16 ranks over 2 pods): the leader's API servers dispatch to
    all 16 ranks with vLLM's internal load balancing; the worker is headless with ranks 8-15."""
    (resource,) = load_moeinferences(EXAMPLES / "deepseek-v3-multinode.yaml")
    out = _assert_launches(render(resource), vllm_release)
    leader, worker = out.answers
    assert leader["path"] == "multi_api_server" and leader["api_server_count"] == 16
    (front,) = leader["front_ends"]
    assert (front["lb"], front["port"], front["ranks"], front["engines"]) == ("internal", 8000, list(range(16)),
                                                                            list(range(8)))
    assert worker["path"] == "headless" and worker["front_ends"][0]["engines"] == list(range(8, 16))


def test_launch_logic_elastic_founders_and_joiners_launch_as_meant(vllm_release):
    """examples/deepseek-v3-elastic.yaml mid-grow (16 -> 32 ranks): the 2 founding pods launch 16 ranks
    with external load balancing (one API server per rank, ranks 0-15), the 2 joining pods -- their
    ranks from their own names through the shell -- launch ranks 16-31 at the size they join (32) with
    the scale-up flag in their env; every pod runs elastic EP with --elastic-ep-max-dp-size 32."""
    if vllm_release.version < "0.33":
        pytest.skip("external elastic EP needs vLLM >= 0.33 (0.32's ParallelConfig refuses it: "
                    "tests/api/test_api_elastic_sources.py)")
    (resource,) = load_moeinferences(EXAMPLES / "deepseek-v3-elastic.yaml")
    resource["status"] = {"elastic": {"dataParallel": 16, "targetDataParallel": 32, "phase": "Starting"}}
    children = render(resource)
    founders = _assert_launches(children, vllm_release)
    joiners = run_shell(joiners_of(children))
    answers = [vllm_release.ask(request(p)) for p in joiners]
    assert [a.get("error") for a in answers] == [None, None], answers
    for out, first, size in [(a, 16 + 8 * j, 32) for j, a in enumerate(answers)] + [
            (a, 8 * i, 16) for i, a in enumerate(founders.answers)]:
        assert out["path"] == "dp_supervisor" and len(out["front_ends"]) == 8
        assert [f["ranks"] for f in out["front_ends"]] == [[r] for r in range(first, first + 8)]
        assert {(f["lb"], f["size"], f["elastic"], f["elastic_max"]) for f in out["front_ends"]} == {
            ("external", size, True, 32)}
    assert all(p.env.get("VLLM_ELASTIC_EP_SCALE_UP_LAUNCH") == "1" for p in joiners)
    assert all("VLLM_ELASTIC_EP_SCALE_UP_LAUNCH" not in p.env for p in founders.pods)


BASE: dict[str, Any] = {
    "apiVersion": "eplb.ai/v1alpha1", "kind": "MoEInference", "metadata": {"name": "grid", "namespace": "default"},
    "spec": {"model": {"name": "deepseek-ai/DeepSeek-R1"}, "engine": {"image": "vllm/vllm-openai:v{release}"},
             "parallelism": {"tensor": 1, "data": 1}, "eplb": {"enabled": True},
             "monitoring": {"podMonitor": {"enabled": True}}},
}
FT = {"spec.faultTolerance": {"enabled": True}, "spec.parallelism.all2allBackend": "deepep_low_latency"}
#: (id, changes): single pod, multi-node internal LB, fault tolerance, several TP/DP/EP shapes; the
#: image is the release's own (``{release}``); surviving lost ranks (``rankFailuresToSurvive``) needs 0.34
GRID = [
    ("single-tp8", {"spec.parallelism": {"tensor": 8, "data": 1}}),
    ("single-dp8", {"spec.parallelism": {"tensor": 1, "data": 8}}),
    ("single-tp2-dp4", {"spec.parallelism": {"tensor": 2, "data": 4}}),
    ("nodes2-dp16", {"spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2}}),
    ("nodes4-dp32", {"spec.parallelism": {"tensor": 1, "data": 32, "nodes": 4}}),
    ("nodes2-tp2-dp8", {"spec.parallelism": {"tensor": 2, "data": 8, "nodes": 2}}),
    ("nodes2-tp8-dp2", {"spec.parallelism": {"tensor": 8, "data": 2, "nodes": 2}}),
    ("single-dp8-4-api-servers", {"spec.parallelism": {"tensor": 1, "data": 8},
                                  "spec.engine.extraArgs": ["--api-server-count", "4"]}),
    ("ft-single-dp8", {**FT, "spec.parallelism": {"tensor": 1, "data": 8, "all2allBackend": "deepep_low_latency"}}),
    ("ft-nodes2-dp16", {**FT, "spec.parallelism": {"tensor": 1, "data": 16, "nodes": 2,
                                                   "all2allBackend": "deepep_low_latency"}}),
    ("ft-nodes16-dp16-one-rank-a-pod", {**FT, "spec.parallelism": {"tensor": 1, "data": 16, "nodes": 16,
                                                                   "all2allBackend": "deepep_low_latency"},
                                        "spec.faultTolerance": {"enabled": True, "rankFailuresToSurvive": 1}}),
    ("ft-nodes2-tp2-dp8", {**FT, "spec.parallelism": {"tensor": 2, "data": 8, "nodes": 2,
                                                      "all2allBackend": "nixl_ep"}}),
    # the recovery's timeout flag, and the operator's control token joining the user's API key
    ("ft-nodes4-dp8-recovery-timeout-api-key", {**FT, "spec.parallelism": {"tensor": 1, "data": 8, "nodes": 4,
                                                                           "all2allBackend": "deepep_low_latency"},
                                                "spec.faultTolerance": {"enabled": True, "recoveryTimeoutSeconds": 90},
                                                "spec.engine.extraArgs": ["--api-key", "user-key"]}),
]


def grid_resource(changes: dict[str, Any], release: str = "0.34.0") -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    out["spec"]["engine"]["image"] = out["spec"]["engine"]["image"].format(release=release)
    for dotted, value in changes.items():
        set_path(out, dotted, value)
    return out


@pytest.mark.parametrize("changes", [c for _, c in GRID], ids=[i for i, _ in GRID])
def test_launch_logic_a_grid_of_layouts_launches_as_meant(vllm_release, changes):
    k = (changes.get("spec.faultTolerance") or {}).get("rankFailuresToSurvive", 0)
    if k and parse_version(vllm_release.release) < FT_SCALE_DOWN_SINCE:
        pytest.skip(f"surviving lost ranks (scale_down) needs vLLM >= 0.34, not {vllm_release.release}")
    _assert_launches(render(grid_resource(changes, vllm_release.release)), vllm_release)


def test_launch_logic_the_per_release_choices_are_the_releases_own(vllm_release):
    """The all2all backends, EPLB config keys and communicators the operator checks per release
    (:mod:`moe_eplb.api.vllm_cli`, generated) are exactly what the release's parser and config offer;
    every key the operator renders in ``--eplb-config`` is one of the release's."""
    from moe_eplb.api import vllm_cli
    from moe_eplb.api.layout import SUPERVISOR_PORT
    from moe_eplb.api.versions import parse_version
    from moe_eplb.render.engine_args import eplb_args

    got = vllm_release.ask({"choices": True})
    version = parse_version(got["version"])
    assert version in vllm_cli.RELEASES, f"vLLM {got['version']} is not read: python scripts/vllm_cli_choices.py"
    want = vllm_cli.RELEASES[version]
    for kind in ("all2all_backends", "eplb_config_keys", "communicators"):
        assert tuple(sorted(got[kind])) == want[kind], (kind, "python scripts/vllm_cli_choices.py regenerates it")
    assert got["supervisor_port"] == want["supervisor_port"] == SUPERVISOR_PORT
    (resource,) = load_moeinferences(EXAMPLES / "deepseek-v3-fault-tolerant.yaml")
    checked = check_for_operator(resource, PROM)
    settings = checked.inference.effective.__class__(**{**checked.inference.effective.__dict__, "use_async": True,
                                                        "communicator": "nixl"})
    args = eplb_args(settings, version)
    rendered = set(yaml.safe_load(args[args.index("--eplb-config") + 1]))
    assert rendered <= set(got["eplb_config_keys"]), rendered - set(got["eplb_config_keys"])


def test_launch_logic_passthrough_is_refused_as_every_release_refuses_it(vllm_release):
    """``all2allBackend: passthrough`` is a value of vLLM's ``All2AllBackend`` that no release's CLI
    offers: the release's parser refuses it, and so does validation (it would never start)."""
    from moe_eplb.api.validation import validate

    (resource,) = load_moeinferences(EXAMPLES / "qwen3-30b-a3b-autotune.yaml")
    answer = vllm_release.ask({"argv": ["serve", "m", "--all2all-backend", "passthrough"], "env": {}})
    assert "invalid choice: 'passthrough'" in answer.get("error", ""), answer
    bad = grid_resource({"spec.parallelism": {"tensor": 1, "data": 8, "all2allBackend": "passthrough"}},
                        vllm_release.release)
    problems = validate(bad)
    assert [p.field for p in problems] == ["spec.parallelism.all2allBackend"], [str(p) for p in problems]
    assert "passthrough" in problems[0].message
