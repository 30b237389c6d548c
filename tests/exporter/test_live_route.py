"""The exporter's ``/eplb/settings`` route (moe_eplb.exporter.server + live_control): only the
operator's token changes anything, refused before the body is read; ``GET`` is read-only; a pod
with live apply off has no route (404, as a plugin that predates it)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from moe_eplb.contracts import live_protocol as lp
from moe_eplb.exporter.server import serve

CMD = {"id": "c", "op": "prepare", "at_step": 10, "grace_steps": 1, "window_size": 5, "step_interval": 9,
       "expect_window_size": 4, "expect_step_interval": 10}


def _post(port: int, body: dict, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{lp.PATH}", data=json.dumps(body).encode(), method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}") if exc.code != 404 else {}


def test_only_the_operators_token_writes_a_command(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    monkeypatch.setenv("MOE_EPLB_CONTROL_TOKEN_FILE", str(token))
    work = tmp_path / "exporter"
    work.mkdir()
    server = serve(CollectorRegistry(), "127.0.0.1", 0, live_directory=str(work))
    port = server.server_address[1]
    try:
        assert _post(port, CMD)[0] == 401
        assert _post(port, CMD, "guess")[0] == 403
        assert not (work / lp.COMMAND_FILE).exists()  # refused: nothing written
        # the token, but no worker has stepped yet: refused with the reason, nothing written
        status, body = _post(port, CMD, "s3cret")
        assert status == 409 and "no worker of this pod runs live apply" in body["error"]
        assert not (work / lp.COMMAND_FILE).exists()
        # a worker that reports (its status file) takes commands; a bad one is refused (400)
        (work / f"{lp.STATUS_PREFIX}{os.getpid()}.json").write_text(lp.RankStatus(
            ep_rank=0, ep_size=1, pid=os.getpid(), step=3, counter=1, window_size=4, step_interval=10).to_json())
        status, body = _post(port, {**CMD, "window_size": 0}, "s3cret")
        assert status == 400 and "window_size: must be > 0" in body["error"]
        status, body = _post(port, {**CMD, "answer_seconds": 0.2}, "s3cret")
        assert status == 200 and body["ranks"][0]["ep_rank"] == 0  # (no worker thread here: not taken)
        assert json.loads((work / lp.COMMAND_FILE).read_text())["id"] == "c"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{lp.PATH}", timeout=10) as resp:
            got = json.loads(resp.read())
        assert got["protocol"] == lp.PROTOCOL and got["ranks"][0]["step"] == 3
    finally:
        server.shutdown()
        server.server_close()
    off = serve(CollectorRegistry(), "127.0.0.1", 0)  # live apply off: no route
    try:
        assert _post(off.server_address[1], CMD, "s3cret")[0] == 404
    finally:
        off.shutdown()
        off.server_close()
