"""Facts of vLLM's external elastic EP the operator relies on, read from each release's own files (the
0.32 CPU wheel installed here, the 0.33.0 and 0.34.0 sources of ``make setup-vllm``): the first release
with it, the launch flags' rules, the env a joining rank carries, vLLM's own bounds of an operation, and
the protocol unchanged from 0.33 to 0.34. (The router and the redundancy rule are RUN on 0.34's code in
tests/controller/test_elastic_vllm_router.py.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from moe_eplb.api import elastic as el
from tests.vllm_sources import vllm_source_root


def source(version: str, rel: str) -> str:
    root, why = vllm_source_root(version)
    if root is None:
        pytest.skip(why)
    return (root / "vllm" / rel).read_text()


def wheel(rel: str) -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM's CPU wheel (0.32) is not installed")
    return (Path(list(spec.submodule_search_locations)[0]) / rel).read_text()


def test_external_elastic_ep_begins_with_033() -> None:
    parallel_032 = wheel("config/parallel.py")
    assert "Elastic EP is not compatible with data_parallel_external_lb" in parallel_032
    with pytest.raises(FileNotFoundError):
        wheel("distributed/elastic_ep/external_elastic_ep.py")
    parallel_033 = source("0.33.0", "config/parallel.py")
    assert "not compatible with data_parallel_external_lb" not in parallel_033
    assert "Elastic EP is not compatible with data_parallel_hybrid_lb" in parallel_033
    assert el.ELASTIC_EXTERNAL_SINCE == (0, 33, 0)


def test_the_protocol_is_the_same_in_033_and_034() -> None:
    for rel in ("distributed/elastic_ep/external_elastic_ep.py", "entrypoints/serve/elastic_ep/api_router.py",
                "entrypoints/serve/elastic_ep/middleware.py"):
        a = source("0.33.0", rel).replace("(str, enum.Enum)", "(enum.StrEnum)")
        assert a == source("0.34.0", rel), rel


def test_the_launch_rules_the_validation_mirrors() -> None:
    parallel = source("0.34.0", "config/parallel.py")
    assert "Elastic EP is only supported with enable_eplb=True." in parallel
    assert "Elastic EP is not supported with pipeline parallelism" in parallel
    assert "Elastic EP with async EPLB requires the NIXL" in parallel and "--eplb-config.use_async=false" in parallel
    assert "--elastic-ep-max-dp-size must be greater than or equal to" in parallel
    serve = source("0.34.0", "entrypoints/cli/serve.py")
    assert 'getattr(args, "enable_elastic_ep", False) and args.api_server_count > 1' in serve  # capped at one
    runner = source("0.34.0", "v1/worker/gpu/eplb_utils.py")
    assert "Elastic EP is not supported with draft model." in runner


def test_a_joining_rank_and_vllms_bounds() -> None:
    envs = source("0.34.0", "envs.py")
    assert f'"{el.SCALE_UP_LAUNCH_ENV}"' in envs
    core = source("0.34.0", "v1/engine/core.py")
    assert "envs.VLLM_ELASTIC_EP_SCALE_UP_LAUNCH" in core and "ExternalElasticEPScaleUpHandshakeMetadata" in core
    ext = source("0.34.0", "distributed/elastic_ep/external_elastic_ep.py")
    ready = re.search(r"def _wait_for_ready_ranks\(.*?timeout_s: float = (\d+)", ext, re.S)
    commit = re.search(r"def _wait_for_local_reconfig_finished\(.*?timeout_s: float = (\d+)", ext, re.S)
    assert (float(ready.group(1)), float(commit.group(1))) == (el.VLLM_PREPARE_TIMEOUT_S, el.VLLM_COMMIT_TIMEOUT_S)
    router = source("0.34.0", "entrypoints/serve/elastic_ep/api_router.py")
    assert f'"{el.SCALE_PATH}"' in router and f'"{el.STATUS_PATH}"' in router
    assert f'body.get("drain_timeout", {el.DEFAULT_DRAIN_TIMEOUT})' in router
    # a failure after prepare leaves the gate closed in external mode: only the non-external path clears it
    llm = source("0.34.0", "v1/engine/async_llm.py")
    drain = llm[llm.index("async def _drain_requests_for_elastic_ep"):llm.index("async def scale_elastic_ep")]
    assert "abort_external_elastic_ep" in drain and "else:\n                set_scaling_elastic_ep(False)" in drain
    assert "if commit_succeeded:\n                set_scaling_elastic_ep(False)" in llm
