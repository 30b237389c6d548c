"""The two distributions: the product (``moe-eplb``, ``operator/``) and the harness (``moe-eplb-harness``,
``harness/``: the simulated cluster, the simulated engines, the demo and the real-engine rig).

The product's wheel holds the product only, imports without the harness (its import closure has no
harness module), and its ``moe-eplb demo`` then says in one line how to get the harness; the harness
registers ``demo`` with the product's CLI through an entry point, and the product does not depend
on the harness."""

from __future__ import annotations

import configparser
import email.parser
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
import tomllib

from moe_eplb.cli import COMMANDS_GROUP, PLUGGED_COMMANDS

ROOT = Path(__file__).resolve().parent.parent


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def test_the_harness_registers_demo_and_the_product_needs_no_harness():
    product, harness = _pyproject(ROOT / "pyproject.toml"), _pyproject(ROOT / "harness" / "pyproject.toml")
    assert harness["project"]["entry-points"][COMMANDS_GROUP] == {"demo": "moe_eplb_harness.demo.command:demo"}
    assert set(PLUGGED_COMMANDS) == {"demo"}
    # the harness runs the product of the same version; the product names no harness anywhere
    assert f"moe-eplb[operator]=={product['project']['version']}" in harness["project"]["dependencies"]
    requirements = [*product["project"]["dependencies"], *sum(product["project"]["optional-dependencies"].values(), [])]
    assert [r for r in requirements if "harness" in r] == []
    # the exporter's vLLM plugin stays the product's
    assert product["project"]["entry-points"]["vllm.general_plugins"] == {
        "moe_eplb_exporter": "moe_eplb.exporter.plugin:register"}


def test_the_installed_demo_command_is_the_harness():
    """Where both are installed (``make setup``), ``moe-eplb demo`` is the harness's click command."""
    from moe_eplb.cli import main
    from moe_eplb_harness.demo.command import demo

    assert main.commands["demo"] is demo


def _symlink_site_without(dest: Path, left_out: tuple[str, ...]) -> Path:
    """A directory of links to every entry of this virtualenv's site-packages but those named
    ``left_out`` (prefixes) and the ``.pth`` files: the product's dependencies without the product or
    the harness."""
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir()
    for entry in site.iterdir():
        if entry.suffix == ".pth" or entry.name.startswith(left_out):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


@pytest.mark.integration
def test_the_product_wheel_has_no_harness_and_imports_without_it(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("moe_eplb-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "product")
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode())
        metadata = email.parser.Parser().parsestr(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"moe_eplb", wheel.name.split("-py")[0] + ".dist-info"}, tops
    assert not [n for n in names if "harness" in n or "/sim/" in n or "vllm_engine" in n]
    assert "moe_eplb/eplb/workload/profiles/profiles.json" in names and "moe_eplb/api/crd.yaml" in names
    assert set(entry_points.sections()) == {"console_scripts", "vllm.general_plugins"}
    assert not [r for r in metadata.get_all("Requires-Dist") or [] if "harness" in r]

    # a Python with the wheel and the product's dependencies, without the harness (nor this checkout)
    deps = _symlink_site_without(tmp_path / "deps", ("moe_eplb", "__editable__"))
    probe = textwrap.dedent(f"""
        import importlib, json, pkgutil, sys
        sys.path[:0] = [{str(tmp_path / "product")!r}, {str(deps)!r}]
        import moe_eplb
        failed = []
        for m in pkgutil.walk_packages(moe_eplb.__path__, "moe_eplb."):
            if not m.name.endswith("__main__"):
                try:
                    importlib.import_module(m.name)
                except Exception as exc:
                    failed.append(f"{{m.name}}: {{type(exc).__name__}}: {{exc}}")
        harness = sorted(n for n in sys.modules if n.startswith("moe_eplb_harness"))
        try:
            importlib.import_module("moe_eplb_harness")
            importable = True
        except ModuleNotFoundError:
            importable = False
        print(json.dumps({{"file": moe_eplb.__file__, "failed": failed, "harness": harness, "importable": importable,
                          "modules": sum(n == "moe_eplb" or n.startswith("moe_eplb.") for n in sys.modules)}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(tmp_path / "product")), got["file"]
    assert got["failed"] == [] and got["harness"] == [] and got["importable"] is False, got
    assert got["modules"] > 100

    # its `moe-eplb demo` says in one line how to get the harness (exit 1, no traceback)
    cli = (f"import sys; sys.path[:0] = [{str(tmp_path / 'product')!r}, {str(deps)!r}]; "
           "sys.argv = ['moe-eplb', 'demo', '--hours', '1']; from moe_eplb.cli import main; main()")
    demo = subprocess.run([sys.executable, "-I", "-S", "-c", cli], capture_output=True, text=True, timeout=120, env=env)
    assert demo.returncode == 1 and demo.stdout == ""
    assert demo.stderr.strip().count("\n") == 0, demo.stderr
    assert "moe-eplb demo:" in demo.stderr and "pip install -e ./harness" in demo.stderr and "make setup" in demo.stderr
