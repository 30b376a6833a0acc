# tests/test_drill_clients.py - the hostile-client drills that wake and convict nobody
# (slow-reader, mac-split, big-request; issue 15), on one process rack for the module: each
# leaves the membership as it found it and measures against its own quiet phase. In a module
# of their own so that the shared rack is down before any other test brings one up (a rack
# kept up through tests/test_drill.py took the next rack's metrics ports and a ZFS drill
# failed).
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_drill import OVERRIDES, _run, assert_recovered, needs_go, rack_down
from tests.test_execution_runtime import needs_agreed
from tests.test_rackctl import write_rack
from zz import rackctl
from zz.config import Config, load


@pytest.fixture(scope="module")
def client_drill_rack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Config]:
    """One rack for the client drills that wake and convict nobody (slow-reader, mac-split,
    big-request): each leaves the membership as it found it and measures against its own
    quiet phase, and bringing a rack up and down costs ~7 s each time."""
    config = load(write_rack(tmp_path_factory.mktemp("client-drills")))
    try:
        rackctl.up(config, overrides=OVERRIDES)
        yield config
    finally:
        rack_down(config)


@pytest.mark.slow
@needs_agreed
@needs_go
def test_slow_reader_drill(client_drill_rack: Config, tmp_path: Path) -> None:
    """A client that never reads its replies, on three connections to every agreement
    replica: honest kv clients stay within the drill's bounds of their quiet throughput and
    p99 latency, no replica's RSS grows more than 32 MiB, and every replica drops the slow
    reader's connections (issue 15 item 4)."""
    r = _run(client_drill_rack, "slow-reader", tmp_path)
    assert_recovered(r)
    sent = r.details["slow_reader"]["sent"]
    assert sent["bytes"] > 64 << 20, sent  # more than one replica's old per-connection bound
    assert sent["closed_by_replica"] > 0, sent
    honest = r.details["honest"]
    assert honest["attack"]["ops_per_s"] >= honest["bound"]["min_ops_per_s"], honest
    assert all(v["growth"] < 32 for v in r.details["agreed_rss_mib"].values())
    assert all(v > 0 for v in r.details["slow_reader_conns_dropped"].values())
    assert r.details["controld_deltas"]["woken"] == 0 and not r.woken


@pytest.mark.slow
@needs_agreed
@needs_go
def test_mac_split_drill(client_drill_rack: Config, tmp_path: Path) -> None:
    """A client whose requests authenticate at the backups but not at the primary (and their
    signed copies with a wrong signature): no view change, honest kv clients within the
    drill's bounds of their quiet throughput and p99 latency (issue 15 item 5)."""
    r = _run(client_drill_rack, "mac-split", tmp_path)
    assert_recovered(r)
    sent = r.details["mac_split"]["sent"]
    assert sent["mac_split"] > 100 and sent["bad_signature"] > 50, sent
    rows = r.details["mac_split_replicas"]
    assert all(row["view_changes"] == 0 for row in rows.values()), rows
    assert sum(row["timer_exempt"] for row in rows.values()) > 100, rows
    honest = r.details["honest"]
    assert honest["attack"]["ops_per_s"] >= honest["bound"]["min_ops_per_s"], honest
    assert r.details["controld_deltas"]["woken"] == 0 and not r.woken


@pytest.mark.slow
@needs_agreed
@needs_go
def test_big_request_drill(client_drill_rack: Config, tmp_path: Path) -> None:
    """A client sending, twice a second, a request over the service's request limit (one
    byte over, 4 MiB, just under 16 MiB) to every agreement replica and a PUT just under the
    limit: no view change, every oversized request refused by every replica with REJECTED
    replies, the ones under it answered, honest kv clients within the drill's bounds
    (issue 15 item 1)."""
    r = _run(client_drill_rack, "big-request", tmp_path)
    assert_recovered(r)
    big = r.details["big_request"]
    sent = big["sent"]
    assert sent["over"] >= 10 and sent["under_ok"] >= 10, sent
    assert sent["over_refused"] >= sent["over"] - 1 and not sent.get("over_unanswered"), sent
    assert max(map(int, big["sizes_over"])) > 15 << 20, big  # just under the frame limit
    rows = r.details["big_request_replicas"]
    assert all(row["view_changes"] == 0 for row in rows.values()), rows
    assert all(row["requests_too_large"] >= sent["over_refused"] for row in rows.values()), rows
    assert all(row["request_limit"] == big["request_limit"] for row in rows.values()), rows
    honest = r.details["honest"]
    assert honest["attack"]["ops_per_s"] >= honest["bound"]["min_ops_per_s"], honest
    assert r.details["controld_deltas"]["woken"] == 0 and not r.woken
