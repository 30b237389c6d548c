"""Child process of tests/controller/test_elastic_vllm_router.py: vLLM's OWN elastic EP router
(``vllm/entrypoints/serve/elastic_ep/api_router.py`` of a release's extracted sources, on
``PYTHONPATH``), one FastAPI app per rank of a group, each served by uvicorn on loopback; behind each
router, as its ``EngineClient``, the harness's simulated rank (:class:`moe_eplb_harness.engines.elastic.RankClient`).

    python elastic_router_child.py PORT_FILE

Ranks 0-3 are a launched group of 4 (2 a pod), ranks 4-5 a new pod already started (ranks 6-7 never
start: a grow to 8 times out), ``--elastic-ep-max-dp-size`` 8. Writes ``{"ranks": {rank: url}, "vllm": version, "router": file}`` to PORT_FILE once every server listens.
One route that is not vLLM's, ``POST /_sim/faults`` (test-only), sets the group's injected faults.

Test-only bridge: this machine's virtualenv has no ``orjson``; ``vllm.entrypoints.serve.utils.api_utils``
imports it for a response helper the elastic router never calls, so an empty module stands in for it
(only when the real one is missing).
"""

import asyncio
import importlib.util
import json
import sys
import time
import types


def main(port_file: str) -> None:
    if importlib.util.find_spec("orjson") is None:  # the test-only bridge (see the module doc)
        sys.modules["orjson"] = types.ModuleType("orjson")
    import uvicorn
    import vllm
    from fastapi import FastAPI, Request
    from vllm.distributed.elastic_ep.external_elastic_ep import (
        ExternalElasticEPScaleCoordinator,
        ExternalElasticEPScalePhase,
    )
    from vllm.entrypoints.serve.elastic_ep import api_router

    from moe_eplb_harness.engines.elastic import ElasticFaults, ElasticGroup, RankClient

    group = ElasticGroup(("test", "router"), launch=4, data_local=2, max_data=8, experts=16, redundant=0,
                         faults=ElasticFaults(join_seconds=0.2, commit_seconds=0.3, launch_seconds=0.0,
                                              prepare_timeout=5.0))
    group.attach("p0", (0, 1), founder=True)
    group.attach("p1", (2, 3), founder=True)
    group.attach("p2", (4, 5), founder=False)
    while group.dp is None:
        time.sleep(0.02)

    servers = []
    urls = {}
    for rank in range(8):
        app = FastAPI()
        app.state.engine_client = RankClient(group, rank)
        api_router.attach_router(app)

        @app.post("/_sim/faults")
        async def faults(request: Request):  # not vLLM's: the test sets the injected faults
            body = await request.json()
            for key, value in body.items():
                setattr(group.faults, key, value)
            return {"ok": True}

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
        servers.append(uvicorn.Server(config))

    async def run() -> None:
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        while not all(s.started for s in servers):
            await asyncio.sleep(0.05)
        for rank, s in enumerate(servers):
            port = s.servers[0].sockets[0].getsockname()[1]
            urls[rank] = f"http://127.0.0.1:{port}"
        with open(port_file, "w", encoding="utf-8") as f:
            json.dump({"ranks": urls, "vllm": vllm.__version__, "router": api_router.__file__,
                       "phases": [p.value for p in ExternalElasticEPScalePhase],
                       "redundancy": redundancy_table(ExternalElasticEPScaleCoordinator)}, f)
        await asyncio.gather(*tasks)

    asyncio.run(run())


#: (experts, redundant, from DP, to DP) cases vLLM's own ``_calculate_num_redundant_experts`` is run on
REDUNDANCY_CASES = ((256, 32, 16, 32), (256, 32, 16, 24), (256, 176, 24, 32), (256, 320, 32, 16), (16, 0, 4, 8),
                    (16, 16, 8, 4), (128, 8, 4, 6), (256, 32, 16, 8))


def redundancy_table(coordinator: type) -> list:
    """vLLM's R' for each case (its method run on a stand-in client holding only the config it reads),
    or the error it raises."""
    out = []
    for experts, redundant, cur, new in REDUNDANCY_CASES:
        eplb = types.SimpleNamespace(num_redundant_experts=redundant)
        config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(eplb_config=eplb),
                                       model_config=types.SimpleNamespace(get_num_experts=lambda e=experts: e))
        this = types.SimpleNamespace(client=types.SimpleNamespace(vllm_config=config))
        try:
            out.append([experts, redundant, cur, new, coordinator._calculate_num_redundant_experts(this, cur, new)])
        except ValueError as exc:
            out.append([experts, redundant, cur, new, str(exc)])
    return out


if __name__ == "__main__":
    main(sys.argv[1])
