"""Multi-node render: no user text reaches a ``sh -c`` script, and leader and workers run the same
argv after Kubernetes' ``$(VAR)`` expansion (issue 24, the worker script injection).

The pods are built as LeaderWorkerSet builds them (:func:`moe_eplb_harness.emulated.lws.group_pod`: its env
first), their ``command`` + ``args`` expanded as the kubelet does
(:func:`moe_eplb_harness.floor.pods.expand_vars`), and then really run: the leader's argv directly, the
worker's through ``/bin/sh``, with a ``vllm`` on ``PATH`` that writes the argv it got.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from moe_eplb.cli import main
from moe_eplb.render.engine_args import SHM_CLEAN
from moe_eplb_harness.emulated import lws as lws_mod
from moe_eplb_harness.floor.pods import container_argv, container_env, expand_vars
from tests.example_manifests import EXAMPLES, load_moeinferences

# --- the expansion itself, per the Kubernetes docs and the cases of its expansion_test.go ----------

ENV = {"VAR_A": "A", "VAR_B": "B", "VAR_C": "", "VAR_REF": "$(VAR_A)"}


@pytest.mark.parametrize("text,want", [
    ("$(VAR_A)", "A"),
    ("___$(VAR_B)___", "___B___"),
    ("$(VAR_A)-$(VAR_A)", "A-A"),
    ("$(VAR_C)", ""),
    ("$$(VAR_B)_$(VAR_A)", "$(VAR_B)_A"),  # $$ escapes
    ("$$$(VAR_A)", "$A"),
    ("$$$$$$(VAR_A)", "$$$(VAR_A)"),
    ("$(UNDEFINED)", "$(UNDEFINED)"),  # undefined: stays as written
    ("$(VAR_A", "$(VAR_A"),  # unclosed
    ("$VAR_A", "$VAR_A"),  # not a reference
    ("$()", "$()"),
    ("$", "$"),
    ("$(", "$("),
    ("f000-$$VAR_A", "f000-$VAR_A"),
    ("$(VAR_REF)", "$(VAR_A)"),  # one pass: a value is not expanded again
    ("$((LWS_WORKER_INDEX * 8))", "$((LWS_WORKER_INDEX * 8))"),
    ("'; id; echo '", "'; id; echo '"),
])
def test_expand_vars_like_kubernetes(text, want):
    assert expand_vars(text, ENV) == want


def test_env_values_expand_with_the_variables_before_them():
    c = {"env": [{"name": "A", "value": "x"}, {"name": "B", "value": "$(A)-$(C)"}, {"name": "C", "value": "c"},
                 {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    assert container_env(c) == {"A": "x", "B": "x-$(C)", "C": "c"}


# --- the rendered LeaderWorkerSet under hostile env values and extra args ---------------------------

HOSTILE_ENV = {
    "EVIL": "'; touch {marker}; echo '",  # closes a single-quoted shell word
    "OPEN": "'$(touch {marker})'",  # ... and runs before `exec` replaces the shell
    "SUBST": "$(touch {marker})",  # a command substitution, if it ever reached a shell
    "TICKS": "`touch {marker}`",
    "SEMI": "x; touch {marker}",
    "QUOTE": "\"; touch {marker}; echo \"",
}
HOSTILE_ARGS = [
    "--open=$(OPEN)", "--evil=$(EVIL)", "$(SUBST)", "$(TICKS)", "--semi", "$(SEMI)", "$(QUOTE)",
    "$$(EVIL)",  # escaped: the literal text $(EVIL)
    "$(UNDEFINED)", "a b  c", "$((1+1))", "$HOME", "'\"", "--index=$(LWS_WORKER_INDEX)",
]


def _render(tmp_path: Path, marker: Path) -> dict:
    doc = copy.deepcopy(load_moeinferences(EXAMPLES / "deepseek-v3-multinode.yaml")[0])
    doc["spec"]["engine"]["env"] = [{"name": k, "value": v.format(marker=marker)} for k, v in HOSTILE_ENV.items()]
    doc["spec"]["engine"]["extraArgs"] = list(HOSTILE_ARGS)
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = CliRunner().invoke(main, ["render", "-f", str(path)])
    assert out.exit_code == 0, out.output
    (lws,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "LeaderWorkerSet"]
    return lws


def _run(argv: list[str], env: dict[str, str], bindir: Path, out: Path) -> list[str]:
    """Run ``argv`` as the container would (env + a fake ``vllm`` on PATH); the argv vllm got."""
    out.unlink(missing_ok=True)
    subprocess.run(argv, env={**env, "PATH": f"{bindir}:/usr/bin:/bin", "VLLM_ARGV_OUT": str(out)},
                   check=True, timeout=30)
    return [a.decode() for a in out.read_bytes().split(b"\0")[:-1]]


def test_hostile_env_and_args_reach_leader_and_workers_as_the_same_argv(tmp_path):
    marker = tmp_path / "pwned"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "vllm"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$VLLM_ARGV_OUT"\n')
    fake.chmod(0o755)
    lws = _render(tmp_path, marker)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    worker_c = lwt["workerTemplate"]["spec"]["containers"][0]
    # no user text in the worker's script: it is the fixed one, every $ escaped for Kubernetes
    assert worker_c["command"] == [
        "/bin/sh", "-c",
        SHM_CLEAN + '; exec vllm serve "$$@" --data-parallel-start-rank "$$((LWS_WORKER_INDEX * 8))" --headless',
        "vllm"]
    argvs, envs = {}, {}
    for index in (0, 1):
        pod = lws_mod.group_pod(lws, lws["spec"], 0, index, "r1")
        (c,) = pod["spec"]["containers"]
        # never clean this machine's /dev/shm: the script cleans a sandbox instead
        shm = tmp_path / f"shm{index}"
        shm.mkdir()
        (shm / "vllm_dist_leftover").write_text("x")
        c["command"][2] = c["command"][2].replace("/dev/shm", str(shm))
        envs[index] = container_env(c)
        argvs[index] = _run(container_argv(c, envs[index]), envs[index], bindir, tmp_path / f"argv{index}")
    assert not marker.exists(), "a hostile env value ran a command"
    assert [list((tmp_path / f"shm{i}").iterdir()) for i in (0, 1)] == [[], []]  # a previous run's leftovers are gone
    leader, worker = argvs[0], argvs[1]
    address = "deepseek-v3-0.deepseek-v3-0.default"  # LWS_LEADER_ADDRESS under the group's headless Service
    expected_user = [
        "--open=" + HOSTILE_ENV["OPEN"].format(marker=marker), "--evil=" + HOSTILE_ENV["EVIL"].format(marker=marker),
        HOSTILE_ENV["SUBST"].format(marker=marker),
        HOSTILE_ENV["TICKS"].format(marker=marker), "--semi", HOSTILE_ENV["SEMI"].format(marker=marker),
        HOSTILE_ENV["QUOTE"].format(marker=marker), "$(EVIL)", "$(UNDEFINED)", "a b  c", "$((1+1))", "$HOME", "'\"",
    ]
    tail = ["--data-parallel-size-local", "8", "--data-parallel-rpc-port", "13345", "--data-parallel-address", address]
    assert leader[-len(tail):] == tail  # no start rank: the leader's API serves every rank
    assert worker[-len(tail) - 3:] == tail + ["--data-parallel-start-rank", "8", "--headless"]
    # everything before the rank-specific tail is the same argv, the hostile values as single arguments
    common_leader, common_worker = leader[: -len(tail)], worker[: -len(tail) - 3]
    assert common_leader[:2] == ["serve", "deepseek-ai/DeepSeek-V3-0324"]
    assert common_leader[-len(expected_user) - 1:] == expected_user + ["--index=0"]
    assert common_worker[:-1] == common_leader[:-1] and common_worker[-1] == "--index=1"


def test_worker_script_has_no_user_text_for_any_data_local(tmp_path):
    """The script depends on dataLocal only; user env names that look like the script's own
    $((...)) or $@ cannot change it, since every $ is written $$."""
    doc = copy.deepcopy(load_moeinferences(EXAMPLES / "deepseek-v3-multinode.yaml")[0])
    doc["spec"]["parallelism"].update({"data": 8, "dataLocal": 4, "nodes": 2})
    doc["spec"]["engine"]["extraArgs"] = ["$(EVIL)"]
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = CliRunner().invoke(main, ["render", "-f", str(path)])
    assert out.exit_code == 0, out.output
    (lws,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "LeaderWorkerSet"]
    c = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    script = c["command"][2]
    assert "EVIL" not in script and "$(EVIL)" in c["args"]
    env = {"(LWS_WORKER_INDEX * 4": "boom", "@": "boom", "EVIL": "x"}
    assert expand_vars(script, env) == (
        SHM_CLEAN + '; exec vllm serve "$@" --data-parallel-start-rank "$((LWS_WORKER_INDEX * 4))" --headless')
