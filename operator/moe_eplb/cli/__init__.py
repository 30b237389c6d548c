"""The ``moe-eplb`` command line.

Each area registers its subcommands from its own module: ``api_cmds`` (validate, render, crd),
``eplb_cmds`` (rebalance, simulate, tune, calibrate, trace; with ``tune_args`` and ``tune_output``),
``operator_cmds`` (run), ``demo_cmd`` (demo). Heavy imports (kopf, matplotlib, vLLM) happen inside
the command bodies, never at import time.
"""

from __future__ import annotations

import importlib

import click

from moe_eplb import __version__

# module name -> what it registers (kept in one place so `moe-eplb --help` lists everything)
_COMMAND_MODULES = (
    "moe_eplb.cli.api_cmds",  # validate, render, crd
    "moe_eplb.cli.eplb_cmds",  # rebalance, simulate, tune, calibrate, trace
    "moe_eplb.cli.operator_cmds",  # run (the operator)
    "moe_eplb.cli.demo_cmd",  # demo
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="moe-eplb")
def main() -> None:
    """Run Mixture-of-Experts models on vLLM with EPLB, and tune EPLB for the live workload."""


def _register_all() -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # an area not built yet, or an optional extra missing
            if exc.name == name:
                continue
            raise
        module.register(main)


_register_all()
