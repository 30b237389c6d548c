"""The ``moe-eplb`` command line.

Each area registers its subcommands from its own module: ``api_cmds`` (validate, render, crd),
``eplb_cmds`` (rebalance, simulate, tune, calibrate, trace; with ``tune_args`` and ``tune_output``),
``operator_cmds`` (run). Other distributions add commands through the entry point group
``moe_eplb.commands`` (:data:`COMMANDS_GROUP`: one click command per entry point, named by it): the
harness (``harness/``, ``moe-eplb-harness``) adds ``demo`` that way; the product never imports it,
and where it is not installed ``moe-eplb demo`` says in one line how to install it. Heavy imports
(kopf, matplotlib, vLLM) happen inside the command bodies, never at import time.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import click

from moe_eplb import __version__

# module name -> what it registers (kept in one place so `moe-eplb --help` lists everything)
_COMMAND_MODULES = (
    "moe_eplb.cli.api_cmds",  # validate, render, crd
    "moe_eplb.cli.eplb_cmds",  # rebalance, simulate, tune, calibrate, trace
    "moe_eplb.cli.operator_cmds",  # run (the operator)
)
#: the entry point group other distributions register ``moe-eplb`` subcommands in (a click command each)
COMMANDS_GROUP = "moe_eplb.commands"
#: commands the documentation promises that come from another distribution: name -> how to get it
PLUGGED_COMMANDS = {
    "demo": "the demo runs on the simulated cluster of the harness distribution, which is not installed here: "
            "from a source checkout, `make setup` (or pip install -e ./harness)",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="moe-eplb")
def main() -> None:
    """Run Mixture-of-Experts models on vLLM with EPLB, and tune EPLB for the live workload."""


def _missing(name: str, why: str) -> click.Command:
    """A stand-in for a command whose distribution is missing or broken: it says why, in one line."""

    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   add_help_option=False, help=f"(not installed) {why}")
    def stand_in() -> None:
        raise click.ClickException(f"moe-eplb {name}: {why}")

    return stand_in


def plugged_commands() -> dict[str, click.Command]:
    """The commands registered in :data:`COMMANDS_GROUP`, by name; a promised one that is missing, or
    an entry point that does not load, becomes a stand-in that says so."""
    found: dict[str, click.Command] = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        try:
            command = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the other commands
            command = _missing(ep.name, f"its entry point {ep.value} does not load ({type(exc).__name__}: {exc})")
        if not isinstance(command, click.Command):
            command = _missing(ep.name, f"its entry point {ep.value} is not a click command")
        found[ep.name] = command
    for name, why in PLUGGED_COMMANDS.items():
        found.setdefault(name, _missing(name, why))
    return found


def _register_all() -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # an area not built yet, or an optional extra missing
            if exc.name == name:
                continue
            raise
        module.register(main)
    for name, command in plugged_commands().items():
        main.add_command(command, name)


_register_all()
