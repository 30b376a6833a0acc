# tests/test_audit.py - controld's audit log of certificates (zz/audit.py, docs/audit.md):
# the file format and chain (append, read back, torn tail, tampered, reordered and removed
# entries), the writer's budget and lock, and end to end a real controld taking real signed
# WAKEUPs and SHUTDOWN votes, then `zz audit verify` and `zz audit show`.
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import struct
from pathlib import Path

import pytest
from test_controld_daemon import SVC, Rack, close_keeping_backend, make_rack, nodes

from zz import audit, cli, wire
from zz.config import Config

HOST = "h0"


def _log(tmp_path: Path, n: int = 4) -> tuple[Path, list[audit.Entry]]:
    """A log with a start entry and n wakeup-like entries carrying a message each."""
    p = tmp_path / "audit.log"
    log = audit.AuditLog.open(p, HOST)
    out = []
    for i in range(n):
        e = log.append(
            {"kind": "wakeup", "verdict": "refused", "service": 1, "seq": i, "reason": "x"},
            [bytes([i]) * (10 + i), b"second"],
        )
        assert e is not None
        out.append(e)
    log.close()
    return p, out


def _records(data: bytes) -> list[bytes]:
    out, o = [], 0
    while o < len(data):
        (bl,) = struct.unpack_from(">I", data, o)
        out.append(data[o : o + 4 + bl + audit.HASH_LEN])
        o += 4 + bl + audit.HASH_LEN
    return out


def test_append_and_read_back(tmp_path: Path) -> None:
    p, written = _log(tmp_path)
    sc = audit.read(p)
    assert sc.error is None and sc.torn is None
    assert [e.kind for e in sc.entries] == ["start"] + ["wakeup"] * 4
    assert [e.n for e in sc.entries] == list(range(5))
    for w, e in zip(written, sc.entries[1:], strict=True):
        assert e.messages == w.messages and e.hash == w.hash and e.header["seq"] == w.header["seq"]
    # The chain: each hash is SHA-256(prev || body), each header names the previous hash.
    prev = audit.GENESIS
    for rec, e in zip(_records(p.read_bytes()), sc.entries, strict=True):
        body = rec[4 : -audit.HASH_LEN]
        assert hashlib.sha256(prev + body).digest() == e.hash == rec[-audit.HASH_LEN :]
        assert e.header["prev"] == prev.hex() and e.header["host"] == HOST
        prev = e.hash
    assert sc.head == prev and sc.end == p.stat().st_size
    # Reopened: the chain continues after a new start entry.
    log = audit.AuditLog.open(p, HOST)
    try:
        assert log.entries == 6 and log.notes == []
        log.append({"kind": "wakeup", "verdict": "acted", "service": 1}, [b"m"])
    finally:
        log.close()
    sc = audit.read(p)
    assert sc.error is None and [e.kind for e in sc.entries][-2:] == ["start", "wakeup"]
    assert sc.entries[5].header["prev"] == sc.entries[4].hash.hex()


def test_torn_tail_is_reported_then_cut_and_logged(tmp_path: Path) -> None:
    p, _ = _log(tmp_path)
    whole = p.read_bytes()
    last = _records(whole)[-1]
    # A crash in the middle of the last append. The record's length is odd or even with the
    # digits of its "time" field, so the kept part is computed, not written -len(last) // 2
    # (which floors towards minus infinity and keeps one byte fewer on an odd length).
    kept = len(last) - len(last) // 2
    p.write_bytes(whole[: len(whole) - len(last) + kept])
    sc = audit.read(p)
    assert sc.error is None and sc.torn is not None
    assert len(sc.entries) == 4 and sc.torn.offset == len(whole) - len(last)
    assert sc.torn.length == kept
    # Not trusted: the torn bytes are no entry, and verify says so (a warning, exit 0).
    cfg = _config(tmp_path)
    out: list[str] = []
    assert audit.verify_command(cfg, path=p, out=out.append) == 0
    assert any("torn tail" in x and "warning" in x for x in out), out
    # controld's next open saves the bytes, cuts them and logs that it did.
    torn = p.read_bytes()[sc.torn.offset :]
    log = audit.AuditLog.open(p, HOST)
    log.close()
    assert len(log.notes) == 1 and "torn tail" in log.notes[0]
    saved = p.with_name(f"audit.log.torn-{sc.torn.offset}")
    assert saved.read_bytes() == torn
    sc2 = audit.read(p)
    assert sc2.error is None and sc2.torn is None
    assert [e.kind for e in sc2.entries][4:] == ["torn-tail", "start"]
    cut = sc2.entries[4].header
    assert cut["offset"] == sc.torn.offset and cut["sha256"] == hashlib.sha256(torn).hexdigest()
    out = []
    assert audit.verify_command(cfg, path=p, out=out.append) == 0
    assert any("torn tail" in x and "was cut" in x for x in out), out


def test_zero_filled_tail_is_torn(tmp_path: Path) -> None:
    p, _ = _log(tmp_path, 1)
    size = p.stat().st_size
    with open(p, "ab") as f:
        f.write(bytes(4096))  # a crash after the size grew, before the data landed
    sc = audit.read(p)
    assert sc.error is None and sc.torn == audit.Torn(size, 4096) and len(sc.entries) == 2


def test_tampered_entry_breaks_the_chain(tmp_path: Path) -> None:
    p, _ = _log(tmp_path)
    data = bytearray(p.read_bytes())
    recs = _records(bytes(data))
    at = len(recs[0]) + len(recs[1]) + len(recs[2]) - audit.HASH_LEN - 3  # entry 2's message
    data[at] ^= 1
    p.write_bytes(bytes(data))
    sc = audit.read(p)
    assert len(sc.entries) == 2 and sc.error is not None and sc.error.startswith("entry 2 ")
    out: list[str] = []
    assert audit.verify_command(_config(tmp_path), path=p, out=out.append) == 1
    assert any(x.startswith("error:") and "entry 2 at offset" in x for x in out), out


def test_rehashed_tampered_entry_is_caught_by_the_next(tmp_path: Path) -> None:
    """One who changes an entry and recomputes its own hash breaks the next link."""
    p, _ = _log(tmp_path)
    recs = _records(p.read_bytes())
    e = audit.read(p).entries
    forged, _ = audit.encode_record(
        e[1].hash, 2, {**e[2].header, "verdict": "acted"}, list(e[2].messages)
    )
    p.write_bytes(b"".join([*recs[:2], forged, *recs[3:]]))
    sc = audit.read(p)
    assert len(sc.entries) == 3 and sc.error is not None and sc.error.startswith("entry 3 ")


def test_reordered_and_removed_entries(tmp_path: Path) -> None:
    p, _ = _log(tmp_path)
    recs = _records(p.read_bytes())
    p.write_bytes(b"".join([recs[0], recs[2], recs[1], *recs[3:]]))
    sc = audit.read(p)
    assert len(sc.entries) == 1 and sc.error is not None and "entry 1 " in sc.error
    p.write_bytes(b"".join([*recs[:2], *recs[3:]]))
    sc = audit.read(p)
    assert len(sc.entries) == 2 and sc.error is not None and "entry 2 " in sc.error


def test_broken_log_is_set_aside_never_appended_to(tmp_path: Path) -> None:
    p, _ = _log(tmp_path)
    recs = _records(p.read_bytes())
    p.write_bytes(b"".join([recs[0], *recs[2:]]))
    log = audit.AuditLog.open(p, HOST)
    log.close()
    assert len(log.notes) == 1 and "set aside" in log.notes[0]
    aside = list(tmp_path.glob("audit.log.broken-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == b"".join([recs[0], *recs[2:]])
    sc = audit.read(p)
    assert sc.error is None and [e.kind for e in sc.entries] == ["start"]
    assert sc.entries[0].header["previous_log"]["set_aside_as"] == str(aside[0])


def test_one_writer_and_the_budget(tmp_path: Path) -> None:
    p = tmp_path / "audit.log"
    log = audit.AuditLog.open(p, HOST, burst=3, rate=0.0)
    try:
        with pytest.raises(audit.AuditError, match="in use"):
            audit.AuditLog.open(p, HOST)
        refused = {"kind": "wakeup", "verdict": "refused", "service": 1}
        got = [log.append(refused, [b"x"]) for _ in range(5)]
        assert [g is not None for g in got] == [True, True, True, False, False]
        assert log.suppressed == 2
        # What leads to an action is never left out, and says what was left out before it.
        e = log.append({"kind": "wakeup", "verdict": "acted", "service": 1}, [b"y"])
        assert e is not None and e.header["suppressed_before"] == 2
        assert log.status()["entries"] == 5 and log.status()["suppressed"] == 2
    finally:
        log.close()
    assert audit.read(p).error is None


def _config(tmp_path: Path) -> Config:
    (tmp_path / "rack").mkdir(exist_ok=True)
    return make_rack(tmp_path / "rack").config


def test_fsync_cost(tmp_path: Path) -> None:
    """What an fsynced append costs here (printed; docs/audit.md quotes it)."""
    import time

    log = audit.AuditLog.open(tmp_path / "audit.log", HOST)
    try:
        msg = os.urandom(900)  # about a WAKEUP with two fault statements
        ts = []
        for i in range(200):
            t0 = time.perf_counter()
            log.append({"kind": "wakeup", "verdict": "acted", "service": 1, "seq": i}, [msg])
            ts.append(time.perf_counter() - t0)
    finally:
        log.close()
    ts.sort()
    print(f"audit append + fsync: median {ts[100] * 1e3:.3f} ms, p99 {ts[198] * 1e3:.3f} ms")
    assert ts[100] < 0.5  # generous: a shared, loaded disk


# ---- end to end: a real controld, real signed certificates ------------------------------


def _cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(list(argv))
    return rc, buf.getvalue()


async def test_controld_logs_every_certificate_and_zz_audit_tells_the_story(
    tmp_path: Path,
) -> None:
    rack: Rack = make_rack(tmp_path)
    web = rack.config.service("web")
    # h2 hosts replica 1 (active, convicted below), h0 the spare 2 (woken below).
    async with nodes(rack, "process", 0, 2) as (h0, h2):
        assert (await h2.rpc("provision", service="web", index=1, mode="active"))["ok"]
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        forged = bytearray(rack.valid_wakeup())
        forged[-1] ^= 1
        await h0.send(bytes(forged))
        await h0.send(rack.valid_wakeup())
        await h0.send(rack.valid_wakeup(sender=3))  # the same round again: duplicate
        assert h0.state(2) == "recovering"
        v0, v1 = rack.shutdown(0, 7, [1], []), rack.shutdown(1, 7, [1], [])
        bad = bytearray(rack.shutdown(2, 7, [1], []))
        bad[-5] ^= 0x40
        await h2.send(v0, rack.shutdown(0, 7, [0], []), bytes(bad))
        await h2.send(v1)
        await h0.send(v0, v1)
        await h2.send(rack.shutdown(2, 7, [1], []))  # a late third vote
        spare = wire.SpareReady(SVC, 16777216 + 2, 1, 7, 0, bytes(32), bytes(32))
        await h2.send(spare.signed(rack.signers[0]).encode())  # controld takes none
        assert h2.counters()["convicted"] == 1 and h0.state(2) == "active"
        st = (await h2.rpc("status"))["audit"]
        assert st["entries"] > 5 and st["failed"] == 0 and st["suppressed"] == 0
        # The convicted runtime's log went with its forensic state; its successor's is new.
        kept = web.exec_state_dir(rack.config, 1).with_name("exec-1.forensic-7")
        old_log = kept / "console" / "replica.log"
        assert old_log.is_file() and old_log.stat().st_size > 0
        new_log = h2.daemon.ctx.home / "replicas" / h2.daemon.inventory.get("web", 1).domain
        new_text = (new_log / "replica.log").read_text(errors="replace")
        assert not new_text.startswith(old_log.read_text(errors="replace"))
    # Offline, after the controlds stopped.
    sc = audit.read(rack.config.rack.run_dir / "controld" / "h2" / "audit.log")
    assert sc.error is None and sc.torn is None
    kinds = [(e.kind, e.verdict, e.header.get("reason")) for e in sc.entries]
    assert ("shutdown", "vote", None) in kinds and ("shutdown", "late", None) in kinds
    assert ("shutdown", "refused", "conflicting") in kinds
    assert ("shutdown", "refused", "bad-signature") in kinds
    assert ("shutdown-certificate", "acted", None) in kinds
    assert ("spare-ready", "sent", None) in kinds
    assert ("spare-ready", "refused", "unexpected-type") in kinds
    cert = next(e for e in sc.entries if e.kind == "shutdown-certificate")
    assert cert.messages == (v0, v1) and cert.header["convict"] == [1]
    assert cert.header["signers"] == [0, 1]
    action = next(e for e in sc.entries if e.kind == "action" and e.header["what"] == "shutdown")
    assert any("console log in" in x for x in action.header["lines"]), action.header
    h0log = audit.read(rack.config.rack.run_dir / "controld" / "h0" / "audit.log")
    wakeups = [e for e in h0log.entries if e.kind == "wakeup"]
    assert [(e.verdict, e.header.get("reason")) for e in wakeups] == [
        ("refused", "bad-signature"), ("acted", None), ("duplicate", "duplicate")
    ]  # fmt: skip
    assert wakeups[1].messages == (rack.valid_wakeup(),)
    assert wakeups[1].header["wake"] == [2] and wakeups[1].header["signers"] == [0, 1]
    # The operator's spare was announced (seq 0) before anything else.
    assert h0log.entries[1].kind == "spare-ready" and h0log.entries[1].header["seq"] == 0

    rc, out = _cli("audit", "verify", str(rack.path))
    assert rc == 0, out
    assert "WAKEUP seq 7 from agreement 0, round awake [x0, x1]: wake x2" in out
    assert "why: replies differ (x0: 0a0a0a0a; x1: 0b0b0b0b)" in out
    assert "agreement 1 at seq 7: x0 on time 0a0a0a0a, x1 on time 0b0b0b0b" in out
    assert "signed by agreement 0, agreement 1: convict x1" in out
    assert "-> convicted web/1 destroyed" in out and "-> woke web/2" in out
    assert out.strip().splitlines()[-1].startswith("ok: 2 log(s)")
    rc, out = _cli("audit", "show", str(rack.path), "--service", "web")
    assert rc == 0, out
    lines = out.splitlines()
    assert "round seq 7:" in lines
    story = "\n".join(lines)
    for want in (
        "[h0] WAKEUP seq 7 from agreement 0 REFUSED (bad-signature",
        "[h0] WAKEUP seq 7 from agreement 0, round awake [x0, x1]: wake x2",
        "fault statements of agreement 0, agreement 1:",
        "[h0] WAKEUP seq 7 from agreement 3, round awake [x0, x1]: wake x2 (duplicate",
        "[h2] SHUTDOWN vote seq 7 from agreement 0 REFUSED (conflicting",
        "[h2] SHUTDOWN vote seq 7 from agreement 2 REFUSED (bad-signature",
        "[h2, h0] SHUTDOWN certificate seq 7, round awake [x0, x1], signed by agreement 0,"
        " agreement 1: convict x1, sleep -, active x0, x2",
        "[h2] SPARE-READY x1 seq 7 epoch 1: fresh spare announced",
        "convicted web/1 destroyed; state kept as",
        "web/2 active (recovered, kept by SHUTDOWN seq 7)",
    ):
        assert want in story, (want, story)
    order = [story.index(w) for w in ("REFUSED (bad-signature", "wake x2", "convict x1",
                                       "SPARE-READY x1")]  # fmt: skip
    assert order == sorted(order), story
    # --json: the same walk and story as documents (issue 17 item 3).
    rc, out = _cli("audit", "verify", str(rack.path), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and doc["errors"] == 0 and len(doc["logs"]) == 2, doc
    events = [ev for lg in doc["logs"] for ev in lg["events"]]
    woke = [ev for ev in events if ev["kind"] == "wakeup"]
    assert woke[0]["header"]["wake"] == [2] and woke[0]["service"] == "web", woke
    assert any(ln.startswith("convicted web/1") for ev in events for ln in ev["lines"]), events
    rc, out = _cli("audit", "show", str(rack.path), "--service", "web", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["service"]["name"] == "web", doc
    kinds = [(e["kind"], e["verdict"], e["hosts"]) for e in doc["entries"] if e["seq"] == 7]
    assert ("shutdown-certificate", "acted", ["h2", "h0"]) in kinds, kinds
    rc, out = _cli("audit", "verify", str(rack.path), "-q")
    assert (rc, out) == (0, "")

    # Tampered afterwards: verify fails naming the entry.
    p = rack.config.rack.run_dir / "controld" / "h2" / "audit.log"
    data = bytearray(p.read_bytes())
    at = cert.offset + 40
    data[at] ^= 1
    p.write_bytes(bytes(data))
    rc, out = _cli("audit", "verify", str(rack.path), "--host", "h2")
    assert rc == 1 and f"entry {cert.n} at offset {cert.offset}" in out, out


def test_verify_catches_an_accepted_entry_that_does_not_verify(tmp_path: Path) -> None:
    """A log whose chain is whole but that claims a forged WAKEUP was acted on (a buggy or
    lying controld): verify names the entry."""
    rack = make_rack(tmp_path)
    p = rack.config.rack.run_dir / "controld" / "h0" / "audit.log"
    log = audit.AuditLog.open(p, "h0")
    forged = bytearray(rack.valid_wakeup())
    forged[-1] ^= 1
    good = rack.valid_wakeup()
    try:
        for raw, verdict in ((good, "acted"), (bytes(forged), "acted"), (bytes(forged), "refused")):
            hdr = {"kind": "wakeup", "verdict": verdict, "service": SVC, "seq": 7, "sender": 0}
            log.append(hdr, [raw])
        # A header that does not match its certificate is caught too.
        log.append({"kind": "wakeup", "verdict": "acted", "service": SVC, "wake": [0]}, [good])
    finally:
        log.close()
    rc, out = _cli("audit", "verify", str(rack.path))
    assert rc == 1
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert len(errors) == 2, out
    assert "entry 2 " in errors[0] and "bad-signature" in errors[0]
    assert "entry 4 " in errors[1] and "the header says wake [0]" in errors[1]
    assert out.splitlines()[-1].startswith("FAILED")


def test_verify_without_a_log(tmp_path: Path) -> None:
    rack = make_rack(tmp_path)
    rc, out = _cli("audit", "verify", str(rack.path))
    assert rc == 1 and "no audit log" in out and str(rack.config.rack.run_dir) in out


async def test_libvirt_console_log_kept_and_torn_tail_at_restart(tmp_path: Path) -> None:
    """libvirt (test:///default): the convicted guest's console.log (which its successor,
    of the same domain name, would overwrite: append='off') moves to its forensic state.
    Then controld dies mid-append: the restarted one cuts the torn tail, says so, logs it."""
    from test_controld_daemon import Node

    from zz.controld import actions
    from zz.controld.hypervisor import open_backend

    rack = make_rack(tmp_path)
    web = rack.config.service("web")
    keep = open_backend("libvirt", uri="test:///default")  # stands for libvirtd
    try:
        async with nodes(rack, "libvirt", 2) as (h2,):
            assert (await h2.rpc("provision", service="web", index=1, mode="active"))["ok"]
            domain = h2.daemon.inventory.get("web", 1).domain
            console = actions.run_dir(h2.daemon.ctx, domain) / "console.log"
            console.write_text("guest: runtime says something odd\n")
            await h2.send(*(rack.shutdown(r, 7, [1], []) for r in (0, 1)))
            assert h2.counters()["convicted"] == 1
            assert h2.daemon.inventory.get("web", 1).domain == domain  # the successor
            kept = web.exec_state_dir(rack.config, 1).with_name("exec-1.forensic-7")
            assert (kept / "console" / "console.log").read_text().startswith("guest: runtime")
            assert not console.exists()
            listed = (await h2.rpc("forensics"))["forensics"]
            assert [x["name"] for x in listed] == [str(kept)]
        p = rack.config.rack.run_dir / "controld" / "h2" / "audit.log"
        before = audit.read(p)
        with open(p, "ab") as f:
            f.write(b"\x00\x00\x01\x00partial record")  # a crash in the middle of an append
        n = Node(rack, 2, "libvirt")
        await n.start()
        try:
            st = await n.rpc("status")
            assert st["counters"]["audit_log_repaired"] == 1
            assert any("torn tail of 18 bytes" in x for x in st["recent"]), st["recent"]
        finally:
            await n.close()
        after = audit.read(p)
        assert after.error is None and after.torn is None
        assert [e.kind for e in after.entries[len(before.entries) :]][:2] == ["torn-tail", "start"]
        rc, out = _cli("audit", "verify", str(rack.path), "--host", "h2")
        assert rc == 0 and "warning:" in out and "torn tail of 18 bytes was cut" in out, out
    finally:
        close_keeping_backend(keep, rack)
