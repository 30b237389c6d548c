"""Put the exporter plugin where a stock vLLM image finds it: the init container's job.

``python -m moe_eplb.exporter.inject DIR`` (run by the init container the operator adds to every
engine pod when ``spec.engine.exporter.inject`` is true, from the operator's image) copies into
``DIR`` (an ``emptyDir`` shared with the engine container):

* the part of ``moe_eplb`` the plugin imports -- the package root, the ``contracts`` package whole and
  ``exporter/`` (the layering test guarantees the exporter imports nothing else, and that every
  contract module lives in ``contracts/``);
* a distribution's metadata, ``moe_eplb_exporter-<version>.dist-info`` with the
  ``vllm.general_plugins`` entry point, so that vLLM's plugin loader
  (``importlib.metadata.entry_points``) finds the plugin once ``DIR`` is on ``PYTHONPATH``.

The engine container then runs with ``PYTHONPATH=DIR`` and ``VLLM_PLUGINS=moe_eplb_exporter``
(the rendered pod sets both). The plugin needs only numpy and prometheus-client at run time, which
vLLM's own images carry. Imports only the standard library and the contracts.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import moe_eplb
from moe_eplb.contracts import k8s_names

#: the packages of moe_eplb the plugin needs, copied whole (besides the package root's __init__.py)
PACKAGES = ("contracts", "exporter")
DIST_NAME = "moe_eplb_exporter"


def dist_info(version: str) -> dict[str, str]:
    """The files of the plugin's ``.dist-info`` directory (name -> text)."""
    return {
        "METADATA": f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {version}\n"
                    "Summary: moe-eplb per-expert load exporter (vLLM general plugin), injected\n",
        "entry_points.txt": f"[{k8s_names.VLLM_PLUGIN_GROUP}]\n"
                            f"{k8s_names.EXPORTER_PLUGIN} = moe_eplb.exporter.plugin:register\n",
        "top_level.txt": "moe_eplb\n",
        "INSTALLER": "moe-eplb-inject\n",
    }


def inject(target: str | os.PathLike) -> list[Path]:
    """Copy the plugin and its metadata into ``target`` (created if needed; replaced if present).

    Returns the files written. Idempotent: running it twice gives the same tree."""
    target = Path(target)
    source = Path(moe_eplb.__file__).resolve().parent
    package = target / "moe_eplb"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    written = [Path(shutil.copy2(source / "__init__.py", package / "__init__.py"))]
    for sub in PACKAGES:
        (package / sub).mkdir()
        for path in sorted((source / sub).glob("*.py")):
            written.append(Path(shutil.copy2(path, package / sub / path.name)))
    meta = target / f"{DIST_NAME}-{moe_eplb.__version__}.dist-info"
    for old in target.glob(f"{DIST_NAME}-*.dist-info"):
        shutil.rmtree(old)
    meta.mkdir()
    for name, text in dist_info(moe_eplb.__version__).items():
        (meta / name).write_text(text, encoding="utf-8")
        written.append(meta / name)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m moe_eplb.exporter.inject DIR (e.g. {k8s_names.EXPORTER_INJECT_DIR})",
              file=sys.stderr)
        return 2
    files = inject(argv[0])
    print(f"moe-eplb exporter {moe_eplb.__version__}: {len(files)} files in {argv[0]}; "
          f"vLLM finds it with PYTHONPATH={argv[0]} VLLM_PLUGINS={k8s_names.EXPORTER_PLUGIN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
