"""What each vLLM release's own parser and config offer, per release the project read: the
``--all2all-backend`` choices, the ``EPLBConfig`` keys (``--eplb-config``) and their ``communicator``
choices, and the multi-port supervisor's default health port.

The block below is GENERATED from each release's code (``python scripts/vllm_cli_choices.py``: it
asks each release's ``vllm serve`` parser and ``EPLBConfig`` through the launch-logic tier's child,
tests/launch_logic/vllm_launcher.py), never edited by hand; the launch-logic tier
(``pytest -k launch_logic``) fails when it differs from a release's code. Validation, the CRD's
rules and :mod:`moe_eplb.api.wide_ep` derive every per-release choice from it. A release newer than
the newest read is taken to offer what the newest offers (the operator refuses nothing it has not
read a reason for; docs/vllm-releases.md says how to take in a release).
"""

from __future__ import annotations

from moe_eplb.api.versions import Version

# BEGIN generated (scripts/vllm_cli_choices.py)
_ALL2ALL_BACKENDS_0_32_0 = (
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_all2allv", "flashinfer_nvlink_one_sided", "flashinfer_nvlink_two_sided", "moonep",
    "mori_high_throughput", "mori_low_latency", "naive", "nixl_ep", "pplx",
)
_ALL2ALL_BACKENDS_0_34_0 = (
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_all2allv", "flashinfer_nvlink_one_sided", "flashinfer_nvlink_two_sided", "moonep",
    "mori", "mori_high_throughput", "mori_low_latency", "naive", "nixl_ep", "pplx",
)
_EPLB_CONFIG_KEYS_0_32_0 = (
    "communicator", "enable_migration_batching", "log_balancedness", "log_balancedness_interval",
    "num_redundant_experts", "policy", "step_interval", "use_async", "window_size",
)
_COMMUNICATORS_0_32_0 = (
    "nixl", "pynccl", "torch_gloo", "torch_nccl", "torch_xccl",
)
_COMMUNICATORS_0_34_0 = (
    "nixl", "pynccl", "symm_mem", "torch_gloo", "torch_nccl", "torch_xccl",
)

RELEASES: dict[Version, dict[str, tuple[str, ...] | int]] = {
    (0, 32, 0): {"all2all_backends": _ALL2ALL_BACKENDS_0_32_0, "eplb_config_keys": _EPLB_CONFIG_KEYS_0_32_0,
                 "communicators": _COMMUNICATORS_0_32_0, "supervisor_port": 9256},
    (0, 33, 0): {"all2all_backends": _ALL2ALL_BACKENDS_0_32_0, "eplb_config_keys": _EPLB_CONFIG_KEYS_0_32_0,
                 "communicators": _COMMUNICATORS_0_32_0, "supervisor_port": 9256},
    (0, 34, 0): {"all2all_backends": _ALL2ALL_BACKENDS_0_34_0, "eplb_config_keys": _EPLB_CONFIG_KEYS_0_32_0,
                 "communicators": _COMMUNICATORS_0_34_0, "supervisor_port": 9256},
}
# END generated


def known() -> tuple[Version, ...]:
    """The releases read, oldest first."""
    return tuple(sorted(RELEASES))


def release_for(version: Version | None) -> Version | None:
    """The release read that stands for ``version``: the newest read at or below it (a newer one:
    the newest read); None for a version older than every release read (or unknown)."""
    if version is None:
        return None
    below = [v for v in known() if v <= tuple(version[:3])]
    return below[-1] if below else None


def offered(kind: str, version: Version | None) -> tuple[str, ...] | None:
    """What release ``version`` offers of ``kind`` (``all2all_backends``, ``eplb_config_keys``,
    ``communicators``); None when no release read stands for it."""
    rel = release_for(version)
    return None if rel is None else tuple(RELEASES[rel][kind])  # type: ignore[arg-type]


def all_offered(kind: str) -> tuple[str, ...]:
    """Everything any release read offers of ``kind``, in the order first seen (oldest release first)."""
    out: dict[str, None] = {}
    for rel in known():
        out.update(dict.fromkeys(RELEASES[rel][kind]))  # type: ignore[arg-type]
    return tuple(out)


def since(kind: str) -> dict[str, Version]:
    """The first release read that offers each choice of ``kind``."""
    out: dict[str, Version] = {}
    for rel in known():
        for name in RELEASES[rel][kind]:  # type: ignore[union-attr]
            out.setdefault(name, rel)
    return out


def dropped(kind: str) -> dict[str, Version]:
    """Choices a release read offered and a later one no longer does: choice -> the first release
    without it (and every one after it is without it too, in what was read)."""
    out: dict[str, Version] = {}
    rels = known()
    for name in all_offered(kind):
        have = [name in RELEASES[r][kind] for r in rels]  # type: ignore[operator]
        last = max(i for i, h in enumerate(have) if h)
        if last + 1 < len(rels):
            out[name] = rels[last + 1]
    return out
