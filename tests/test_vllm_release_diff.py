"""scripts/vllm_release_diff.py (what a new vLLM release changes for moe-eplb) and scripts/vllm_src.py
(a release's Python sources without installing it): on synthetic trees, and on the real 0.33.0 and
0.34.0 sources where `make setup-vllm` extracted them (offline: ``--sources``)."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

from tests import ROOT
from tests.vllm_sources import vllm_source_root


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


diff = _load("vllm_release_diff")
vllm_src = _load("vllm_src")

STATE_OLD = '''
from vllm.config.utils import compute_hash_cached

class EplbState:
    def step(self, is_dummy=False, is_profile=False, log_stats=False):
        """Old words."""
        self.should_record_tensor.fill_(True)

    def rearrange(self):
        return 1
'''
STATE_NEW = '''
from vllm.config.utils import hash_config_cached

class EplbState:
    def step(self, is_dummy=False, is_profile=False, log_stats=False):
        """New words, same code."""
        self.should_record_tensor.fill_(True)

    def rearrange(self):
        return 2
'''


def _tree(base: Path, version: str, files: dict[str, str]) -> Path:
    for rel, text in {"_version.py": f"__version__ = version = '{version}'\n", **files}.items():
        path = base / version / "vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base / version


def test_statuses_on_synthetic_trees(tmp_path) -> None:
    old = _tree(tmp_path, "1.0.0", {"distributed/eplb/eplb_state.py": STATE_OLD, "gone.py": "X = 1\n",
                                    "models/a.py": "class AForCausalLM(nn.Module, MixtureOfExperts):\n    pass\n"})
    new = _tree(tmp_path, "1.1.0", {"distributed/eplb/eplb_state.py": STATE_NEW,
                                    "models/b.py": "class AForCausalLM(nn.Module):\n    pass\n"})
    E = "distributed/eplb/eplb_state.py"
    deps = [diff.Dep("x", E, "EplbState.step"), diff.Dep("x", E, "EplbState.rearrange"),
            diff.Dep("x", E, "compute_hash_cached", "import"), diff.Dep("x", E, "hash_config_cached", "import"),
            diff.Dep("x", "gone.py", kind="file"), diff.Dep("x", E, "EplbState.add_model"),
            diff.Dep("x", "", "AForCausalLM", "bases"), diff.Dep("x", E, "should_record_tensor.fill_", "string")]
    rows = diff.compare(old, new, deps)
    assert [r.status for r in rows] == ["same", "changed", "removed", "added", "removed", "absent", "changed", "same"]
    assert rows[6].where == "models/a.py -> models/b.py"  # moved, and no longer MixtureOfExperts
    text = diff.render(rows, "1.0.0", "1.1.0", diff=True)
    assert text.splitlines()[0] == ("vLLM 1.0.0 -> 1.1.0: 8 dependencies of moe-eplb: 2 changed, 1 added, "
                                    "2 removed, 2 same, 1 absent")
    assert "    -    return 1" in text and "    +    return 2" in text
    assert "changed  x          distributed/eplb/eplb_state.py:EplbState.rearrange" in text


def test_sources_dir_must_hold_both_releases(tmp_path, capsys) -> None:
    _tree(tmp_path, "1.0.0", {})
    with pytest.raises(SystemExit, match="1.1.0/vllm does not exist"):
        diff.main(["1.0.0", "1.1.0", "--sources", str(tmp_path)])


def test_real_033_to_034(capsys) -> None:
    roots = [vllm_source_root(v) for v in ("0.33.0", "0.34.0")]
    for root, why in roots:
        if root is None:
            pytest.skip(why)
    assert roots[0][0].parent == roots[1][0].parent, "the two releases are not side by side"
    assert diff.main(["0.33.0", "0.34.0", "--sources", str(roots[0][0].parent)]) == 0
    out = capsys.readouterr().out
    lines = {" ".join(line.split("  (")[0].split()) for line in out.splitlines()[1:]}
    for expected in (
        "removed exporter distributed/eplb/eplb_state.py:compute_hash_cached",
        "added exporter distributed/eplb/eplb_state.py:hash_config_cached",
        "removed exporter v1/worker/gpu_model_runner.py",
        "changed exporter distributed/eplb/eplb_state.py:EplbState._update_layer_should_record",
        "changed exporter distributed/eplb/eplb_state.py:EplbState._all_ranks_result_ready",
        'added exporter distributed/eplb/async_worker.py string "Async EPLB rearranged %d/%d layers of %s in %.2f s."',
        "same exporter v1/worker/gpu/model_runner.py:GPUModelRunner.eplb_state",
        "same policy distributed/eplb/policy/default.py",
        "same exporter distributed/eplb/eplb_state.py:EplbState.rearrange",
        "added validation config/parallel.py:ParallelConfig.compute_eplb_num_redundant_experts",
    ):
        assert expected in lines, f"{expected!r} not in the report:\n{out}"


def test_extract_keeps_only_python_and_dist_info(tmp_path) -> None:
    wheel = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm/_version.py", "__version__ = version = '9.9.9'\n")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF")
        zf.writestr("vllm/x/y.py", "Y = 1\n")
        zf.writestr("vllm-9.9.9.dist-info/METADATA", "Name: vllm\n")
    assert vllm_src.extract_wheel(wheel, tmp_path / "out") == 3
    assert vllm_src.extracted_version(tmp_path / "out") == "9.9.9"
    assert not (tmp_path / "out" / "vllm" / "_C.abi3.so").exists()


def test_fetch_reports_a_failed_download(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="pip download vllm==9.9.8 failed"):
        vllm_src.fetch("9.9.8", tmp_path, pip=["false"])


def test_fetch_reuses_an_extracted_release(tmp_path) -> None:
    _tree(tmp_path, "9.9.9", {})
    assert vllm_src.fetch("9.9.9", tmp_path, pip=["false"]) == tmp_path / "9.9.9"


def test_requirements_list_the_source_releases() -> None:
    assert vllm_src.versions_in(ROOT / "requirements" / "vllm-src.txt") == ["0.33.0", "0.34.0"]
