"""The exporter's relay of an elastic resize (moe_eplb.exporter.elastic_relay): the operator's control
token or nothing, the request forwarded to every API server of the pod, each answer kept by the
operation's id, and a status that says whether the ranks serve."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry

from moe_eplb.contracts import k8s_names
from moe_eplb.exporter.elastic_relay import ElasticRelay, detail, post_json
from moe_eplb.exporter.server import serve


class FakeApi:
    """Stands in for one vLLM API server: records the resize requests it got, answers them after
    ``delay`` with ``code``; ``/is_scaling_elastic_ep`` with ``phase``; ``/v1/models`` 200 or 503."""

    def __init__(self, code: int = 200, delay: float = 0.0, phase: str = "idle", serving: bool = True) -> None:
        self.code, self.delay, self.phase, self.serving = code, delay, phase, serving
        self.got: list[dict] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: object) -> None:
                data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/scale_elastic_ep":
                    api.got.append(json.loads(body))
                    time.sleep(api.delay)
                    return self._answer(api.code, {"message": "Scaled"} if api.code == 200 else {"detail": "Scale failed"})
                self._answer(200, {"is_scaling_elastic_ep": False, "phase": api.phase, "epoch": "e1", "error": None,
                                   "requested_data_parallel_size": 8})

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/v1/models":
                    return self._answer(200 if api.serving else 503, {"data": []})
                self._answer(200, 'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_waiting{engine="0"} 1.0\n')

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def apis():
    made: list[FakeApi] = []
    yield lambda **kw: made.append(FakeApi(**kw)) or made[-1]
    for a in made:
        a.close()


def wait_done(relay: ElasticRelay, op: str) -> dict:
    for _ in range(200):
        ranks = relay.status()["operations"][op]["ranks"]
        if all(r["state"] == "done" for r in ranks):
            return relay.status()
        time.sleep(0.02)
    raise AssertionError("the forwards did not finish")


def test_the_relay_forwards_to_every_api_server_and_keeps_each_answer(apis) -> None:
    a, b = apis(), apis(code=500)
    relay = ElasticRelay((a.url, b.url))
    assert relay.scale({"op": "dp8-1", "new_data_parallel_size": 8, "drain_timeout": 30}) == (
        202, {"op": "dp8-1", "accepted": True, "ranks": 2})
    st = wait_done(relay, "dp8-1")
    assert a.got == b.got == [{"new_data_parallel_size": 8, "drain_timeout": 30}]
    ranks = {r["url"]: r for r in st["operations"]["dp8-1"]["ranks"]}
    assert (ranks[a.url]["code"], ranks[b.url]["code"], ranks[b.url]["detail"]) == (200, 500, "Scale failed")
    assert [r["status"]["phase"] for r in st["ranks"]] == ["idle", "idle"]
    assert [r["serving"] for r in st["ranks"]] == [True, True] and [r["inFlight"] for r in st["ranks"]] == [3.0, 3.0]
    # a repeat of the same operation changes nothing; another one after it is accepted
    assert relay.scale({"op": "dp8-1", "new_data_parallel_size": 8})[0] == 200 and len(a.got) == 1
    assert relay.scale({"op": "dp4-2", "new_data_parallel_size": 4})[0] == 202


def test_one_operation_at_a_time_and_bad_bodies_refused(apis) -> None:
    slow = apis(delay=0.5)
    relay = ElasticRelay((slow.url,))
    assert relay.scale({"op": "a", "new_data_parallel_size": 8})[0] == 202
    code, body = relay.scale({"op": "b", "new_data_parallel_size": 4})
    assert code == 409 and "operation a is still running" in body["error"]
    for bad in (None, {"new_data_parallel_size": 8}, {"op": "x", "new_data_parallel_size": 0},
                {"op": "x", "new_data_parallel_size": 8, "drain_timeout": -1}, {"op": "x", "new_data_parallel_size": True}):
        assert relay.scale(bad)[0] == 400, bad
    assert ElasticRelay(()).scale({"op": "x", "new_data_parallel_size": 8})[0] == 409


def test_a_paused_rank_is_reported_not_serving(apis) -> None:
    assert ElasticRelay((apis(serving=False).url,)).status()["ranks"][0]["serving"] is False
    gone = ElasticRelay(("http://127.0.0.1:9",)).status()["ranks"][0]
    assert gone["serving"] is None and gone["status"] is None and gone["statusCode"] == 0


def test_detail_reads_vllms_error_bodies() -> None:
    assert detail('{"detail": "Scale failed"}') == "Scale failed"
    assert detail('{"error": {"message": "boom"}}') == "boom"
    assert detail("plain\ntext") == "plain text"


def _post(url: str, body: dict, headers: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_exporter_takes_a_resize_only_with_the_operators_token(apis, tmp_path, monkeypatch) -> None:
    """The pod's exporter server: a resize from anyone without the token (or with another) is refused
    and nothing reaches vLLM; the operator's is relayed. The status is read-only and open."""
    api = apis()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    monkeypatch.setenv(k8s_names.CONTROL_TOKEN_FILE_ENV, str(token))
    server = serve(CollectorRegistry(), "127.0.0.1", 0, relay=ElasticRelay((api.url,)))
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        body = {"op": "dp8-1", "new_data_parallel_size": 8}
        assert _post(base + k8s_names.ELASTIC_SCALE_PATH, body, {})[0] == 401
        assert _post(base + k8s_names.ELASTIC_SCALE_PATH, body, {"Authorization": "Bearer guess"})[0] == 403
        assert api.got == []
        code, text = _post(base + k8s_names.ELASTIC_SCALE_PATH, body, {"Authorization": "Bearer s3cret"})
        assert code == 202 and json.loads(text)["accepted"] is True
        with urllib.request.urlopen(base + k8s_names.ELASTIC_STATUS_PATH, timeout=5) as r:
            status = json.loads(r.read())
        assert "dp8-1" in status["operations"]
        for _ in range(100):
            if api.got:
                break
            time.sleep(0.02)
        assert api.got == [{"new_data_parallel_size": 8, "drain_timeout": 120}]
    finally:
        server.shutdown()
        server.server_close()


def test_a_forward_nothing_answers_records_why() -> None:
    """The relay's POST to an API server that does not answer: status 0 and what went wrong, which the
    operation's rank record shows (as ``detail``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, text = post_json(f"http://127.0.0.1:{port}/scale_elastic_ep", {"new_data_parallel_size": 2}, 5)
    assert code == 0 and "Connection refused" in text and text.startswith("URLError: ")
    assert detail(text) == text
