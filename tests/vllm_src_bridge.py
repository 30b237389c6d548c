"""pytest plugin (``-p tests.vllm_src_bridge``) for the child pytest that runs the vLLM contract
modules against a released wheel's Python sources (tests/test_vllm_sources.py).

Such a tree has no compiled parts and this machine has no Triton CPU backend. vLLM 0.34's CPU
platform refuses to build any ``VllmConfig`` on x86 without Triton ("vLLM on x86 CPUs requires
Triton (triton-cpu)", ``vllm/platforms/cpu.py`` ``check_and_update_config``), although the contract
tests never launch a kernel. The bridge runs that check with Triton reported present and changes
nothing else; on releases whose check does not read ``HAS_TRITON`` (0.33 and older) it does nothing.
"""

from __future__ import annotations

import inspect

BRIDGED = "_moe_eplb_triton_bridge"


def apply() -> bool:
    """Bridge the CPU platform's Triton check; True when it was needed (and is now bridged)."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config
    if getattr(check, BRIDGED, False):
        return True
    if triton_utils.HAS_TRITON or "HAS_TRITON" not in inspect.getsource(check):
        return False
    original = check.__func__

    def check_and_update_config(cls, vllm_config):
        saved, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
        try:
            return original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = saved

    setattr(check_and_update_config, BRIDGED, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True


def pytest_configure(config) -> None:
    apply()
