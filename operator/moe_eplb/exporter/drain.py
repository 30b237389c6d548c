"""The engine pod's ``preStop`` hook: ``python3 -m moe_eplb.exporter.drain``.

Run by the kubelet as an ``exec`` hook inside the engine container (so inside the pod's network
namespace), it sends ``POST /drain`` to the pod's own exporter on loopback
(``127.0.0.1:$MOE_EPLB_EXPORTER_PORT``, default 9400) and waits for the answer: the exporter turns
the pod unready and answers once vLLM has no request in flight, or the drain time is up
(:mod:`moe_eplb.exporter.health`). The exporter accepts the drain from loopback only, so no other
pod, scraper or node process can take this pod out of service. Exits 0 when drained, 1 when the
exporter could not be reached or refused (the kubelet then goes on with SIGTERM, and vLLM's own
``--shutdown-timeout`` still lets running requests finish). Standard library only, besides the
exporter's own :mod:`~moe_eplb.exporter.health` (it runs in a stock vLLM image from the injected plugin
directory).
"""

from __future__ import annotations

import os
import sys

from moe_eplb.contracts import k8s_names
from moe_eplb.exporter.health import http_post

ENV_PORT = "MOE_EPLB_EXPORTER_PORT"
#: beyond the drain time: what the exporter may take to notice vLLM is idle or gone
ANSWER_MARGIN_SECONDS = 30.0


def drain_url(env: dict[str, str] | os._Environ) -> str:
    port = (env.get(ENV_PORT) or "").strip()
    port = port if port.isdigit() else str(k8s_names.EXPORTER_PORT)
    return f"http://127.0.0.1:{port}{k8s_names.EXPORTER_DRAIN_PATH}"


def request_drain(url: str, timeout: float) -> tuple[int, str]:
    """(status, body) of ``POST url``; status 0 when nothing answers."""
    return http_post(url, b"", timeout)


def main(env: dict[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    try:
        seconds = float(env.get(k8s_names.DRAIN_SECONDS_ENV) or 600.0)
    except ValueError:
        seconds = 600.0
    url = drain_url(env)
    status, body = request_drain(url, max(seconds, 0.0) + ANSWER_MARGIN_SECONDS)
    text = body.strip() or f"HTTP {status}"
    if status == 200:
        print(f"moe-eplb preStop: {text}")
        return 0
    print(f"moe-eplb preStop: no drain ({url}: {text}); vLLM's shutdown timeout finishes what runs",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
