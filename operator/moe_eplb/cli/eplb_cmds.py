"""``moe-eplb rebalance | simulate | tune | trace``: the EPLB math on the command line.

Shared module: each command lives in its own ``_add_<name>(main)`` function, owned by the engineer
of that area; ``register`` calls them all. Heavy imports stay inside the command bodies.
"""

from __future__ import annotations

import json
import sys

import click


def register(main: click.Group) -> None:
    _add_rebalance(main)


# --- rebalance (policy) ------------------------------------------------------------------------

_REBALANCE_FLAGS = {
    "num_replicas": "--replicas",
    "num_groups": "--groups",
    "num_nodes": "--nodes",
    "num_gpus": "--gpus",
    "weight": "--weights",
}


def _read_weights(path: str) -> list:
    """The ``--weights`` file: JSON, a 2-D list ``[L][E]`` of non-negative numbers."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--weights")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"{path} is not valid JSON ({exc})", param_hint="--weights")
    if not isinstance(data, list) or not data or not all(isinstance(row, list) for row in data):
        raise click.BadParameter(
            f"{path} must hold a non-empty 2-D list [layers][experts] of numbers",
            param_hint="--weights",
        )
    width = len(data[0])
    for i, row in enumerate(data):
        if len(row) != width:
            raise click.BadParameter(
                f"{path}: row {i} has {len(row)} experts, row 0 has {width}; every layer needs "
                "the same number of experts",
                param_hint="--weights",
            )
        for j, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise click.BadParameter(
                    f"{path}: [{i}][{j}] is {value!r}, not a number", param_hint="--weights"
                )
    return data


def _add_rebalance(main: click.Group) -> None:
    @main.command("rebalance")
    @click.option("--weights", "weights_path", required=True, metavar="FILE.json",
                  help="JSON 2-D list [layers][experts]: load (tokens) of each logical expert.")
    @click.option("--replicas", type=int, required=True,
                  help="Physical expert slots (logical + redundant), a multiple of --gpus.")
    @click.option("--groups", type=int, required=True,
                  help="Expert groups (DeepSeek-V3: 8; use 1 for models without groups).")
    @click.option("--nodes", type=int, required=True, help="Nodes (hierarchical if groups % nodes == 0).")
    @click.option("--gpus", type=int, required=True, help="GPUs, i.e. EP ranks.")
    def rebalance_cmd(weights_path: str, replicas: int, groups: int, nodes: int, gpus: int) -> None:
        """Place experts on GPUs exactly as vLLM's default EPLB policy does.

        Prints JSON {"phy2log": [[...]], "logcnt": [[...]]}: for each layer, the logical expert of
        each physical slot (GPU-major: slots g*S..(g+1)*S-1 are GPU g's, S = replicas / gpus) and
        the replica count of each logical expert.
        """
        from moe_eplb.eplb.policy import PolicyError, rebalance

        weights = _read_weights(weights_path)
        try:
            phy2log, _, logcnt = rebalance(weights, replicas, groups, nodes, gpus)
        except PolicyError as exc:
            hint = _REBALANCE_FLAGS.get(exc.param, exc.param)
            reason = f"{weights_path}: {exc.reason}" if exc.param == "weight" else exc.reason
            raise click.BadParameter(reason, param_hint=hint)
        json.dump({"phy2log": phy2log.tolist(), "logcnt": logcnt.tolist()}, sys.stdout)
        sys.stdout.write("\n")
