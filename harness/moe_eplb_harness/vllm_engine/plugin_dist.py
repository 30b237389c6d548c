"""Make a not-installed Python package visible to vLLM as a general plugin, by ``PYTHONPATH`` only.

vLLM finds general plugins with ``importlib.metadata.entry_points(group="vllm.general_plugins")``
and filters them by ``VLLM_PLUGINS``. ``importlib.metadata`` scans every ``sys.path`` entry for
``*.dist-info`` directories, so a directory holding the code *and* a minimal
``<name>-<version>.dist-info`` (``METADATA`` + ``entry_points.txt``) is enough: put it on the
process's ``PYTHONPATH`` (inherited by vLLM's engine-core and worker processes) and add the plugin
name to ``VLLM_PLUGINS``. No ``pip install``, no write to the image's site-packages.

The tests use it for the CPU EPLB bridge (:mod:`moe_eplb_harness.vllm_engine.cpu_eplb_bridge`). The same
mechanism is how the operator can inject the exporter into a stock vLLM image (a volume with
``moe_eplb/`` + ``moe_eplb-<v>.dist-info`` mounted and put on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import re
import shutil

GROUP = "vllm.general_plugins"


def write_dist_info(site_dir: str, dist_name: str, version: str, entry_points: dict[str, str],
                    group: str = GROUP) -> str:
    """Write ``<site_dir>/<dist>-<version>.dist-info`` declaring ``entry_points`` ({name: "mod:func"})
    in ``group``; returns its path."""
    norm = re.sub(r"[-_.]+", "_", dist_name)
    path = os.path.join(site_dir, f"{norm}-{version}.dist-info")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    with open(os.path.join(path, "entry_points.txt"), "w") as f:
        f.write(f"[{group}]\n")
        for name, target in entry_points.items():
            f.write(f"{name} = {target}\n")
    with open(os.path.join(path, "RECORD"), "w") as f:
        f.write("")
    return path


def make_plugin_dir(site_dir: str, sources: list[str], dist_name: str, entry_points: dict[str, str],
                    version: str = "0.0.0") -> str:
    """Copy ``sources`` (module files or package directories) into ``site_dir`` and declare the
    distribution; returns ``site_dir`` (put it on ``PYTHONPATH``)."""
    os.makedirs(site_dir, exist_ok=True)
    for src in sources:
        dst = os.path.join(site_dir, os.path.basename(src.rstrip("/")))
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst)
    write_dist_info(site_dir, dist_name, version, entry_points)
    return site_dir


def prepend_path(env: dict[str, str], *dirs: str) -> dict[str, str]:
    """``env`` with ``dirs`` put first on its ``PYTHONPATH``."""
    parts = [d for d in dirs if d] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def allow_plugin(env: dict[str, str], name: str) -> dict[str, str]:
    """``env`` with ``name`` added to ``VLLM_PLUGINS`` (an allow-list; unset means all)."""
    env = dict(env)
    current = env.get("VLLM_PLUGINS")
    if current is None:
        return env  # every discovered plugin loads already
    names = [n for n in current.split(",") if n]
    if name not in names:
        names.append(name)
    env["VLLM_PLUGINS"] = ",".join(names)
    return env
