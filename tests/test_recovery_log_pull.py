# tests/test_recovery_log_pull.py - what log a replica behind the stable checkpoint pulls from
# the agreement replicas before it recovers (execution/runtime.py _on_fetch_reply).
from __future__ import annotations

from pathlib import Path

from conftest import RACK_TOML

from zz import keys, wire
from zz.config import load
from zz.crypto import sha256
from zz.execution.runtime import Runtime, RuntimeOptions


class _Sent:
    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.sent: list[bytes] = []

    def send(self, raw: bytes) -> None:
        self.sent.append(raw)


def _runtime(tmp_path: Path) -> Runtime:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "rack.toml"
    path.write_text(RACK_TOML.format(base_port=17200).replace('sleep = "paused"', ""))
    config = load(path)
    keys.generate(config)
    rt = Runtime(config, config.services[0], 0, RuntimeOptions(state_dir=tmp_path / "st"))
    rt.agree_keys = {r: bytes([r]) * 32 for r in range(4)}  # start() loads the real ones
    return rt


def _big_log(first: int, last: int) -> bytes:
    """Log entries first..last whose encoding passes the refetch threshold (1 MiB)."""
    size = (1 << 20) // (last - first + 1) + 1
    entries = []
    for seq in range(first, last + 1):
        batch = wire.batch_encoding(1000, seq, [bytes([seq % 256]) * size])
        entries.append((seq, sha256(batch), batch))
    return wire.log_encoding(entries)


def test_a_replica_recovering_past_the_log_it_got_pulls_no_more_of_it(tmp_path: Path) -> None:
    """A woken spare (last executed 0) gets the log the agreement replicas keep, from the
    stable checkpoint before theirs on, cut at ~4 MiB per reply. While it does not know
    where it recovers to, it asks for the rest; once g+1 replicas named the checkpoint it
    recovers to, log below it is of no use (the registration after the install asks for
    what follows it), so it asks no more: the whole log (tens of MiB in the Figure 9
    bench) held its loop for 0.4 s before the replay could start."""
    rt = _runtime(tmp_path)
    stable = (64, sha256(b"checkpoint 64"))
    data = _big_log(1, 40)
    links = [_Sent(r) for r in range(3)]
    for r in range(2):
        rt._on_fetch_reply(links[r], wire.FetchReply(rt.svc.id, r, wire.FETCH_LOG, *stable, data))  # type: ignore[arg-type]
    # The first reply named the checkpoint alone: more log was asked for. The second made
    # it certified (g+1 = 2): no more.
    assert rt._recover_target == stable
    assert len(links[0].sent) == 1 and links[1].sent == []
    asked = wire.decode(links[0].sent[0])
    assert isinstance(asked, wire.Fetch) and asked.seq == 40
    assert rt.counters["log_refetch_skipped"] == 1


def test_a_recovering_replica_does_not_hash_log_it_cannot_replay(tmp_path: Path) -> None:
    """Once it recovers to a certified checkpoint, a reply whose log starts above the
    replica's next seq is neither decoded nor followed up; a replica that recovers to
    nothing takes the same reply in full and asks for the rest."""
    rt = _runtime(tmp_path)
    stable = (64, sha256(b"checkpoint 64"))
    rt._recover_target = stable
    above = _big_log(41, 80)
    link = _Sent(2)
    rt._on_fetch_reply(link, wire.FetchReply(rt.svc.id, 2, wire.FETCH_LOG, *stable, above))  # type: ignore[arg-type]
    assert link.sent == [] and rt.counters["log_replies_skipped"] == 1
    assert rt.collector.pending() == []
    other = _runtime(tmp_path / "other")
    link = _Sent(2)
    other._on_fetch_reply(link, wire.FetchReply(rt.svc.id, 2, wire.FETCH_LOG, *stable, above))  # type: ignore[arg-type]
    assert len(link.sent) == 1 and other.collector.pending() == list(range(41, 81))


def test_a_log_entry_whose_batch_does_not_hash_adds_no_vote(tmp_path: Path) -> None:
    """The collector takes a FETCH-REPLY's batches without hashing them again (hashed=True):
    wire.log_reply has checked each against its digest, and a reply with one that does not
    match counts nothing."""
    rt = _runtime(tmp_path)
    batch = wire.batch_encoding(1000, 1, [b"real"])
    forged = wire.log_encoding([(1, sha256(batch), wire.batch_encoding(1000, 1, [b"fake"]))])
    reply = wire.FetchReply(rt.svc.id, 0, wire.FETCH_LOG, 0, sha256(b"none"), forged)
    rt._on_fetch_reply(_Sent(0), reply)  # type: ignore[arg-type]
    assert rt.counters["bad_log"] == 1 and rt.collector.pending() == []
    good = wire.log_encoding([(1, sha256(batch), batch)])
    for r in range(3):
        reply = wire.FetchReply(rt.svc.id, r, wire.FETCH_LOG, 0, sha256(b"none"), good)
        rt._on_fetch_reply(_Sent(r), reply)  # type: ignore[arg-type]
    cert = rt.collector.next_ready()
    assert cert is not None and cert.seq == 1 and cert.batch == batch


def test_the_log_above_the_checkpoint_being_installed_is_taken_during_the_install(
    tmp_path: Path,
) -> None:
    """At the start of an install the replica registers from the checkpoint it installs
    (FETCH kind 3 from its seq), so the agreement replicas send the log above it while the
    install runs: a reply whose log starts right above that checkpoint is decoded and
    voted at once (and its rest asked for), one that starts anywhere else is not. The
    replay's first batch then needs no log exchange after the install (98-164 ms at 1 GB
    in the Figure 9 bench)."""
    rt = _runtime(tmp_path)
    stable = (5000, sha256(b"checkpoint 5000"))
    rt._recover_target = stable
    rt._installing = stable[0]
    rt.collector.expect(stable[0])
    asked = wire.decode(rt._fetch_msg(1))
    assert isinstance(asked, wire.Fetch) and asked.seq == 5000
    below = _big_log(4961, 5000)
    link = _Sent(0)
    rt._on_fetch_reply(link, wire.FetchReply(rt.svc.id, 0, wire.FETCH_LOG, *stable, below))  # type: ignore[arg-type]
    assert link.sent == [] and rt.collector.pending() == []
    above = _big_log(5001, 5040)
    for r in range(3):
        link = _Sent(r)
        rt._on_fetch_reply(link, wire.FetchReply(rt.svc.id, r, wire.FETCH_LOG, *stable, above))  # type: ignore[arg-type]
        more = wire.decode(link.sent[0])
        assert isinstance(more, wire.Fetch) and more.seq == 5040
    # Kept although 5001 is more than the collector's window above last executed (0).
    assert rt.collector.pending() == list(range(5001, 5041))
    rt.collector.executed(5000)  # what the install does
    cert = rt.collector.next_ready()
    assert cert is not None and cert.seq == 5001
    # After the install it registers again from the end of what is certified here, so
    # that what was committed meanwhile comes, and not the tail a second time.
    assert rt.collector.ready_through() == 5040


def test_a_replica_out_of_log_behind_a_peer_checkpoint_registers_again(tmp_path: Path) -> None:
    """A replica the agreement replicas count asleep gets no batches pushed, only the log a
    registration (FETCH kind 3) brings. Once it has executed all of it while a peer signed
    a checkpoint above it, the stall loop registers again, though it holds no vote above
    itself; before, it stayed there (tests/test_recovery.py
    test_checkpoint_collected_while_recovering_from_it timed out now and then: the spare
    recovered, replayed the log it was sent and stopped short of the peers)."""
    rt = _runtime(tmp_path)
    links = [_Sent(r) for r in range(4)]
    rt._links = links  # type: ignore[assignment]
    assert rt._stall_tick(-1) == 0 and all(link.sent == [] for link in links)
    assert rt._stall_tick(0) == 0 and all(link.sent == [] for link in links)  # no peer ahead
    rt.ckpt.votes[16] = {wire.exec_principal(1): sha256(b"checkpoint 16")}
    assert rt._stall_tick(0) == 0
    for link in links:
        (asked,) = [wire.decode(raw) for raw in link.sent]
        assert isinstance(asked, wire.Fetch) and asked.kind == wire.FETCH_LOG and asked.seq == 0
    assert rt.counters["refetches"] == 1
