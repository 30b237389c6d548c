"""The start-up announcement of a replica under required peering writes kopf's own peer record."""

from __future__ import annotations

import datetime

from kopf._core.engines.peering import Peer  # the parser kopf applies to the peering object's status

from moe_eplb.controller.peering import peer_entry
from moe_eplb.controller.settings import PRIORITY_RANGE, seniority_priority


def test_peer_entry_is_read_by_kopf_as_a_live_peer() -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    entry = peer_entry(seniority_priority(), 60, now)
    peer = Peer(identity="op-0", **entry)
    assert not peer.is_dead
    assert peer.priority == entry["priority"] and PRIORITY_RANGE[0] <= peer.priority <= PRIORITY_RANGE[1]
    stale = Peer(identity="op-1", **peer_entry(5, 60, now - datetime.timedelta(seconds=120)))
    assert stale.is_dead
