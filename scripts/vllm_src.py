#!/usr/bin/env python3
"""Fetch released vLLM versions' Python sources without installing them.

For each version: ``pip download vllm==X --no-deps`` (the GPU wheel; nothing is installed and no
dependency is resolved) and extract only its ``*.py`` files and its ``.dist-info`` to
``DEST/<X>/`` (so ``DEST/<X>/vllm/_version.py`` says ``X``). A version already extracted there is
kept. Used by the Makefile's ``.vllm-src-done`` target (every ``vllm==X`` line of
requirements/vllm-src.txt) and by scripts/vllm_release_diff.py.

    python scripts/vllm_src.py --dest .venv/vllm-src -r requirements/vllm-src.txt
    python scripts/vllm_src.py --dest /tmp/vllm-src 0.34.0 0.35.0
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def extracted_version(root: Path) -> str | None:
    """The version ``root/vllm/_version.py`` declares, or None."""
    path = root / "vllm" / "_version.py"
    if not path.is_file():
        return None
    match = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", path.read_text())
    return match.group(1) if match else None


def versions_in(requirements: Path) -> list[str]:
    """Every ``vllm==X`` of a requirements file."""
    return re.findall(r"^\s*vllm==([0-9][0-9A-Za-z.+-]*)\s*$", requirements.read_text(), re.M)


def extract_wheel(wheel: Path, dest: Path) -> int:
    """Extract ``*.py`` files and the dist-info of ``wheel`` into ``dest``; returns the file count."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".py") or ".dist-info/" in n]
        zf.extractall(dest, names)
    return len(names)


def fetch(version: str, dest: Path, pip: list[str] | None = None) -> Path:
    """``dest/<version>`` holding vLLM ``version``'s Python sources (downloaded when missing)."""
    root = dest / version
    if extracted_version(root) == version:
        return root
    pip = pip or [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        proc = subprocess.run([*pip, "download", "--no-deps", "--quiet", "-d", tmp, f"vllm=={version}"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download vllm=={version} failed: {proc.stderr.strip()[-800:]}")
        wheels = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download vllm=={version} left no wheel in {tmp}")
        extract_wheel(wheels[0], root)
    if extracted_version(root) != version:
        raise RuntimeError(f"{root}: the wheel of vllm=={version} declares {extracted_version(root)}")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", required=True, type=Path, help="directory that receives <version>/")
    parser.add_argument("-r", "--requirements", type=Path, help="take the versions from vllm==X lines")
    parser.add_argument("versions", nargs="*", help="vLLM versions, e.g. 0.34.0")
    args = parser.parse_args(argv)
    versions = list(args.versions) + (versions_in(args.requirements) if args.requirements else [])
    if not versions:
        parser.error("give versions or -r FILE")
    for version in versions:
        try:
            print(fetch(version, args.dest))
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
