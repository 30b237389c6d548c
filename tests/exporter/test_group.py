"""One L x E copy per replica group: the pod's role, the leader's merge (restarts included), and the
real servers: a worker serves its totals, the leader fetches them and exports the group's counter."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client.exposition import generate_latest

from moe_eplb.contracts import metric_names
from moe_eplb.exporter import snapshot as snap
from moe_eplb.exporter.collector import PodCollector
from moe_eplb.exporter.group import (
    GROUP_PATH,
    GroupMerge,
    GroupRole,
    PeerPoller,
    WorkerTotals,
    decode,
    encode,
    worker_urls,
)
from moe_eplb.exporter.server import make_registry, serve
from moe_eplb.metrics.scrape import exposition_samples


def test_role_from_the_leaderworkerset_env():
    assert GroupRole.from_env({}).role == "single"
    lws = {"LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": "4", "LWS_LEADER_ADDRESS": "ds-1.ds.team-a"}
    leader = GroupRole.from_env(lws, port=9400)
    assert (leader.role, leader.size) == ("leader", 4)
    assert leader.peers == ("http://ds-1-1.ds.team-a:9400", "http://ds-1-2.ds.team-a:9400",
                            "http://ds-1-3.ds.team-a:9400")
    assert GroupRole.from_env({**lws, "LWS_WORKER_INDEX": "2"}) == GroupRole("worker", 2, 4)
    assert GroupRole.from_env({**lws, "MOE_EPLB_EXPORTER_GROUP": "off"}).role == "single"
    assert GroupRole.from_env({**lws, "LWS_GROUP_SIZE": "1"}).role == "single"
    peers = GroupRole.from_env({**lws, "MOE_EPLB_EXPORTER_GROUP_PEERS": "http://a:1, http://b:2/,http://c:3"})
    assert peers.peers == ("http://a:1", "http://b:2", "http://c:3")
    for bad in ({**lws, "MOE_EPLB_EXPORTER_GROUP": "on"}, {**lws, "LWS_WORKER_INDEX": "x"},
                {**lws, "LWS_WORKER_INDEX": "4"}, {**lws, "MOE_EPLB_EXPORTER_GROUP_PEERS": "http://a:1"},
                {"LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": "2"}):
        with pytest.raises(ValueError):
            GroupRole.from_env(bad)
    assert worker_urls("", 3, 9400) == ()


def test_encode_decode_round_trip_and_garbage():
    a = np.arange(6.0).reshape(2, 3)
    back = decode(encode({"m": (12.5, a), "m (draft)": (13.0, a[:1])}, {"m": a - 1}))
    assert back["m"][0] == 12.5 and back["m (draft)"][0] == 13.0 and back["m (draft)"][2] is None
    np.testing.assert_array_equal(back["m"][1], a)
    np.testing.assert_array_equal(back["m"][2], a - 1)
    with pytest.raises(ValueError, match=GROUP_PATH):
        decode(b"not an npz")


def test_merge_counts_each_token_once_through_worker_restarts():
    m = GroupMerge(start_time=100.0)
    own = np.zeros((1, 2))
    m.update(1, {"m": (101.0, np.array([[5.0, 1.0]]))})  # started after the leader: counted from zero
    np.testing.assert_array_equal(m.merged("m", own), [[5, 1]])
    m.update(1, {"m": (101.0, np.array([[7.0, 4.0]]))})
    np.testing.assert_array_equal(m.merged("m", own), [[7, 4]])
    m.update(1, {"m": (150.0, np.array([[2.0, 0.0]]))})  # restarted (new start time): +2, +0 on top
    np.testing.assert_array_equal(m.merged("m", own), [[9, 4]])
    m.update(1, {"m": (150.0, np.array([[1.0, 3.0]]))})  # a value dropped, same start time: a restart too
    np.testing.assert_array_equal(m.merged("m", own + 1), [[11, 8]])
    assert m.pods("m") == 2 and m.pods("other") == 1
    # a restarted leader counts a worker from the baseline it hands over (the previous leader's
    # last fetch): nothing twice, nothing missed
    late = GroupMerge(start_time=200.0)
    late.update(3, {"m": (150.0, np.array([[40.0, 40.0]]), np.array([[39.0, 38.0]]))})
    late.update(3, {"m": (150.0, np.array([[41.0, 42.0]]))})
    np.testing.assert_array_equal(late.merged("m", own), [[2, 4]])
    # a model of another shape is never added
    np.testing.assert_array_equal(late.merged("m", np.zeros((2, 2))), np.zeros((2, 2)))


def _pod_dir(tmp_path, name, ranks, scale, start=100.0, L=2, E=4, ep=8):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    for r in ranks:
        et = (np.arange(L * E, dtype=float).reshape(L, E) + 1) * scale * (r + 1)
        rt = np.zeros((L, ep))
        rt[:, r] = scale
        reps = np.ones((L, E), np.int64)
        reps[0, 1] = 2
        snap.write(str(d), snap.WorkerSnapshot(pid=1000 + r, time=0.0, models=[snap.ModelSnapshot(
            name="m", ep_rank=r, ep_size=ep, expert_tokens=et, rank_tokens=rt, replicas=reps, steps=10,
            rearrangements=1, duration_sum=0.5, window_size=10, step_interval=30, num_redundant_experts=0,
            use_async=False, start_time=start)]))
    return str(d)


def _samples(body: bytes, name: str) -> dict:
    return {tuple(sorted(lab.items())): v for n, lab, v in exposition_samples(body.decode(), {name}) if n == name}


def test_leader_exports_the_group_sum_over_http_workers_only_their_per_rank_series(tmp_path):
    dirs = [_pod_dir(tmp_path, f"p{w}", range(2 * w, 2 * w + 2), scale=w + 1.0) for w in range(3)]
    servers, workers = [], []
    try:
        for w in (1, 2):
            c = PodCollector(dirs[w], "full", role=GroupRole("worker", w, 3))
            workers.append(c)
            servers.append(serve(make_registry(c), "127.0.0.1", 0, group_totals=WorkerTotals(c.own)))
        urls = tuple(f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
        role = GroupRole("leader", 0, 3, urls)
        merge = GroupMerge(start_time=100.0)
        assert PeerPoller(role, merge).poll_once() == 2
        leader = generate_latest(make_registry(PodCollector(dirs[0], "full", role=role, merge=merge)))
        with urllib.request.urlopen(urls[0] + "/metrics") as r:
            worker_body = r.read()
        old = [generate_latest(make_registry(PodCollector(d, "full"))) for d in dirs]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
    et = metric_names.EXPERT_TOKENS
    want = {}
    for body in old:  # the per-pod layout, summed over pods as PromQL and the reader do
        for k, v in _samples(body, et).items():
            want[k] = want.get(k, 0.0) + v
    assert _samples(leader, et) == want and len(want) == 8
    assert not _samples(worker_body, et) and not _samples(worker_body, metric_names.EXPERT_REPLICAS)
    assert _samples(leader, metric_names.EXPERT_REPLICAS) == _samples(old[0], metric_names.EXPERT_REPLICAS)
    assert list(_samples(leader, metric_names.EXPORTER_GROUP_PODS).values()) == [3.0]
    assert list(_samples(worker_body, metric_names.EXPORTER_GROUP_PODS).values()) == [0.0]
    # the per-rank families stay on every pod, as before
    assert _samples(worker_body, metric_names.RANK_TOKENS) == _samples(old[1], metric_names.RANK_TOKENS)
    assert _samples(worker_body, metric_names.ENGINE_STEPS) == _samples(old[1], metric_names.ENGINE_STEPS)
    # a pod outside a group exports no group gauge (its output is unchanged)
    assert not _samples(old[0], metric_names.EXPORTER_GROUP_PODS)


def test_a_worker_that_does_not_answer_is_retried_and_its_counts_arrive_later(tmp_path):
    d = _pod_dir(tmp_path, "w1", [2, 3], scale=1.0)
    role = GroupRole("leader", 0, 2, ("http://127.0.0.1:9",))  # nothing listens on port 9
    merge = GroupMerge(start_time=100.0)
    assert PeerPoller(role, merge, timeout=0.5).poll_once() == 0
    assert merge.pods("m") == 1
    c = PodCollector(d, "full", role=GroupRole("worker", 1, 2))
    server = serve(make_registry(c), "127.0.0.1", 0, group_totals=WorkerTotals(c.own))
    try:
        role = GroupRole("leader", 0, 2, (f"http://127.0.0.1:{server.server_address[1]}",))
        assert PeerPoller(role, merge).poll_once() == 1
    finally:
        server.shutdown()
        server.server_close()
    np.testing.assert_array_equal(merge.merged("m", np.zeros((2, 4))), c.own()["m"][1])


def test_a_worker_hands_a_new_leader_what_the_previous_one_fetched():
    now = {"m": (10.0, np.array([[1.0, 2.0]]))}
    w = WorkerTotals(lambda: now)
    assert decode(w.answer("leader-a"))["m"][2] is None  # the first leader: no baseline (count from 0)
    now = {"m": (10.0, np.array([[5.0, 6.0]]))}
    assert decode(w.answer("leader-a"))["m"][2] is None
    now = {"m": (10.0, np.array([[7.0, 9.0]]))}
    got = decode(w.answer("leader-b"))["m"]  # a restarted leader: from leader-a's last fetch on
    np.testing.assert_array_equal(got[2], [[5.0, 6.0]])
    now = {"m": (99.0, np.array([[1.0, 1.0]]))}  # the worker restarted too: its new counts are all new
    assert decode(w.answer("leader-c"))["m"][2] is None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 30.0) -> bytes:
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.integration  # two exporter server processes
def test_the_server_processes_take_their_roles_from_the_leaderworkerset_env(tmp_path):
    """``python -m moe_eplb.exporter.server`` as the plugin starts it in a leader pod and a worker
    pod: the leader's counter is the sum of both pods' counts, the worker exports no L x E series."""
    import os
    import subprocess
    import sys
    import time

    dirs = [_pod_dir(tmp_path, f"p{w}", range(2 * w, 2 * w + 2), scale=w + 1.0, ep=4) for w in range(2)]
    ports = [_free_port(), _free_port()]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LWS_", "MOE_EPLB_"))}
    base.update(PYTHONPATH=os.pathsep.join(sys.path), MOE_EPLB_EXPORTER_ADDRESS="127.0.0.1",
                MOE_EPLB_EXPORTER_FLUSH_SECONDS="0.2", LWS_GROUP_SIZE="2", LWS_LEADER_ADDRESS="unused.invalid",
                MOE_EPLB_EXPORTER_START_TIME="100.0")
    envs = [{**base, "LWS_WORKER_INDEX": "0", "MOE_EPLB_EXPORTER_DIR": dirs[0], "MOE_EPLB_EXPORTER_PORT": str(ports[0]),
             "MOE_EPLB_EXPORTER_GROUP_PEERS": f"http://127.0.0.1:{ports[1]}"},
            {**base, "LWS_WORKER_INDEX": "1", "MOE_EPLB_EXPORTER_DIR": dirs[1], "MOE_EPLB_EXPORTER_PORT": str(ports[1])}]
    procs = [subprocess.Popen([sys.executable, "-m", "moe_eplb.exporter.server"], env=e, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for e in envs]
    try:
        worker = _get(f"http://127.0.0.1:{ports[1]}/metrics")
        deadline = time.monotonic() + 30
        while True:  # until the leader has fetched its worker once
            leader = _get(f"http://127.0.0.1:{ports[0]}/metrics")
            if list(_samples(leader, metric_names.EXPORTER_GROUP_PODS).values()) == [2.0] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            p.terminate()
        errs = [p.communicate(timeout=30)[1].decode() for p in procs]
    assert list(_samples(leader, metric_names.EXPORTER_GROUP_PODS).values()) == [2.0], errs
    et = metric_names.EXPERT_TOKENS
    want: dict = {}
    for d in dirs:
        for k, v in _samples(generate_latest(make_registry(PodCollector(d, "full"))), et).items():
            want[k] = want.get(k, 0.0) + v
    assert _samples(leader, et) == want
    assert not _samples(worker, et) and list(_samples(worker, metric_names.EXPORTER_GROUP_PODS).values()) == [0.0]
    assert "group worker 1" in errs[1] and "group leader" in errs[0], errs
