"""The recovery loop's HTTP calls to the engines' fault-tolerance routes (aiohttp; nothing decided here).

Every call carries the operator's control token (``Authorization: Bearer``, :mod:`.control`): vLLM
checks it where its ``--api-key`` guards the routes (0.34's ``/v1/fault_tolerance/*``, and only when
the resource runs with an API key: the operator then adds its token to vLLM's keys,
:mod:`moe_eplb.render.control_key`); elsewhere the header is ignored. Pod IPs are dialled directly,
one API server (one data-parallel rank) per port.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from moe_eplb.api import ft_protocol as ftp
from moe_eplb.api.versions import Version
from moe_eplb.controller.control import auth_header
from moe_eplb.controller.recovery import RankReading

#: seconds a status read may take (the loop polls every rank every tick)
STATUS_TIMEOUT_S = 2.0
#: seconds an instruction may take to be accepted (vLLM answers 202 before it runs it)
APPLY_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Endpoint:
    """One rank's API server: ``http://ip:port``."""

    rank: int
    ip: str
    port: int

    @property
    def base(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}"


def reading_of(body: object, rank: int) -> RankReading:
    """The :class:`RankReading` of ``rank`` in a ``GET .../fault_tolerance/status`` answer: the entry
    whose ``id`` is the rank (one API server manages one engine in external load balancing), else
    the only one."""
    engines = body.get(ftp.KEY_ENGINES) if isinstance(body, dict) else None
    if not isinstance(engines, list) or not engines:
        return RankReading()
    entry = next((e for e in engines if isinstance(e, dict) and e.get(ftp.KEY_ID) == rank), None)
    if entry is None:
        entry = engines[0] if len(engines) == 1 and isinstance(engines[0], dict) else {}
    mask = entry.get(ftp.KEY_MASK)
    return RankReading(status=_str(entry.get(ftp.KEY_STATUS)), ft_state=_str(entry.get(ftp.KEY_FT_STATE)),
                       last_request_id=_str(entry.get(ftp.KEY_LAST_REQUEST)), error=_str(entry.get(ftp.KEY_FT_ERROR)),
                       mask=tuple(int(b) for b in mask) if isinstance(mask, list) else ())


def accepted_id(text: str) -> str | None:
    """The ``request_id`` of an apply route's 202 answer (``{"message", "request_id"}``)."""
    try:
        body = json.loads(text)
    except ValueError:
        return None
    return _str(body.get(ftp.FIELD_REQUEST_ID)) if isinstance(body, dict) else None


def _str(v: object) -> str | None:
    return v if isinstance(v, str) else None


class RecoveryClient:
    """One aiohttp session for the loop's calls (closed with :meth:`close`)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=128))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def status(self, ep: Endpoint, version: Version, token: str | None) -> RankReading:
        """One rank's reading (``status`` None when it does not answer, or not with JSON)."""
        headers = auth_header(token) if token else {}
        try:
            async with self._http().get(ep.base + ftp.status_path(version), headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return RankReading()
                return reading_of(json.loads(await resp.text()), ep.rank)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
            return RankReading()

    async def statuses(self, eps: list[Endpoint], version: Version, token: str | None) -> dict[int, RankReading]:
        got = await asyncio.gather(*(self.status(ep, version, token) for ep in eps))
        return {ep.rank: r for ep, r in zip(eps, got)}

    async def apply(self, ep: Endpoint, version: Version, body: dict, token: str | None) -> tuple[int, str]:
        """POST one instruction; ``(HTTP status, reply)`` (0 when the rank did not answer)."""
        headers = {"Content-Type": "application/json", **(auth_header(token) if token else {})}
        try:
            async with self._http().post(ep.base + ftp.apply_path(version), data=json.dumps(body), headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=APPLY_TIMEOUT_S)) as resp:
                return resp.status, (await resp.text())[:500]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return 0, f"{type(exc).__name__}: {exc}"

    async def send_round(self, eps: list[Endpoint], version: Version, body: dict,
                         token: str | None) -> dict[int, tuple[int, str]]:
        """The same instruction to every rank at once (vLLM gives them 10 s to check in together)."""
        got = await asyncio.gather(*(self.apply(ep, version, body, token) for ep in eps))
        return {ep.rank: r for ep, r in zip(eps, got)}
