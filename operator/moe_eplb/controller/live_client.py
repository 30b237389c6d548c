"""The operator's HTTP calls to its engine pods' live-apply route (``/eplb/settings`` on the
``eplb-metrics`` port, :mod:`moe_eplb.contracts.live_protocol`): the one place these requests are
made. Every ``POST`` carries the operator's control token (:func:`moe_eplb.controller.control.auth_header`).

Each call returns an :class:`Answer` and never raises for what a pod does: no answer (refused
connection, timeout) is ``status 0`` with the error, any HTTP status is kept with the body (JSON, or
the text of a plugin that does not speak JSON on that path).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from moe_eplb.contracts import live_protocol as lp
from moe_eplb.controller.control import auth_header


@dataclass(frozen=True)
class Answer:
    """A pod's answer: the HTTP status (0: none) and its JSON body (``{}`` when not JSON), or the error."""

    status: int
    body: dict = field(default_factory=dict)
    error: str = ""

    @property
    def ranks(self) -> list[lp.RankStatus]:
        out = []
        for raw in self.body.get("ranks") or []:
            try:
                out.append(lp.RankStatus.from_mapping(raw))
            except (TypeError, ValueError):
                continue
        return out


async def _call(method: str, url: str, *, body: dict | None = None, headers: dict | None = None,
                timeout: float) -> Answer:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.request(method, url, json=body, headers=headers) as resp:
                text = await resp.text()
                try:
                    parsed: Any = json.loads(text) if text else {}
                except ValueError:
                    parsed = {"error": text.strip()[:300]}
                return Answer(resp.status, parsed if isinstance(parsed, dict) else {}, "")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        return Answer(0, {}, f"{type(exc).__name__}: {exc}".rstrip(": ") or type(exc).__name__)


async def get_settings(base_url: str, timeout: float = 5.0) -> Answer:
    """``GET /eplb/settings`` of one pod's exporter (``base_url``: ``http://host:port``)."""
    return await _call("GET", base_url.rstrip("/") + lp.PATH, timeout=timeout)


async def send_command(base_url: str, token: str, cmd: lp.Command, *, answer_seconds: float,
                       timeout: float | None = None) -> Answer:
    """``POST /eplb/settings`` with ``cmd`` and the control token; the pod answers once its ranks
    took the command or after ``answer_seconds``."""
    body = {**json.loads(cmd.to_json()), "answer_seconds": answer_seconds}
    return await _call("POST", base_url.rstrip("/") + lp.PATH, body=body, headers=auth_header(token),
                       timeout=timeout if timeout is not None else answer_seconds + 10.0)
