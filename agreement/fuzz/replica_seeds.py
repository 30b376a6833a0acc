#!/usr/bin/env python3
"""replica_seeds.py - write the hand-made seeds of fuzz_replica (fuzz/fuzz_replica.c).

    python3 agreement/fuzz/replica_seeds.py agreement/fuzz/corpus/fuzz_replica

An input is byte 0 (replica id = b % 4; bit 2: external execution with 3 execution
replicas) and then events, each an op byte (event() in fuzz_replica.c) followed by the bytes
its builder reads. Every byte string is a valid input (reads past the end give 0), so these
seeds only have to start the fuzzer in useful places: a request ordered end to end, a
checkpoint made stable, a view change to view 1, execution reports that disagree, a fault
round with WAKEUP and SHUTDOWN. The fuzzer's own finds are merged next to them (make
fuzz-corpus). Bytes after the op are the builder's reads in order; zeros mostly mean "the
replica's own state": view + 0, seq stable + 1, the digest of the batch just built.
"""

from __future__ import annotations

import sys
from pathlib import Path

# op bytes (event() in fuzz_replica.c, op % 24)
REQUEST, PRE_PREPARE, PREPARE, COMMIT, CHECKPOINT = 0, 2, 3, 4, 5
VIEW_CHANGE, NEW_VIEW, FETCH, FETCH_REPLY, STATUS = 6, 7, 8, 9, 10
EXEC_REPORT, EXEC_CHECKPOINT, FAULT, WAKEUP, SHUTDOWN, SPARE = 11, 12, 13, 14, 15, 16
MUTATE, REPLAY, CLOSE, TICK, QUORUM, QUORUM_CKPT, RAW = 17, 18, 19, 20, 21, 22, 23


def request(client: int, ts: int, op: bytes = b"x", conn: int = 0) -> bytes:
    # client, flags, op length, op, timestamp byte (>= 200: absolute), MAC to all, delivery
    return bytes([REQUEST, client, 0, len(op)]) + op + bytes([200 + ts % 55, 1, conn])


def pre_prepare(sender: int = 0, client: int = 0, conn: int = 1) -> bytes:
    # sender, view+0, seq stable+1, skew 0, nd_seed, 1 request: the client's pending one
    # (odd byte), MAC to all, delivery
    return bytes([PRE_PREPARE, sender, 0, 0, 0, 7, 1, client, 1, 1, conn])


def quorum(commit: bool, seq_byte: int = 0, digest_byte: int = 0, rid: int = 1) -> bytes:
    # view+0, seq, digest (0: the batch just built; 1: the replica's slot), then per sender
    # (all others; for PREPARE not the primary, replica 0) a MAC choice and a delivery byte
    senders = 3 if commit or rid == 0 else 2
    return bytes([QUORUM, 1 if commit else 0, 0, seq_byte, digest_byte]) + bytes([1, 2] * senders)


def tick(step: int) -> bytes:
    return bytes([TICK, step])


def quorum_checkpoint(seq_byte: int, digest_byte: int = 2) -> bytes:
    return bytes([QUORUM_CKPT, seq_byte, digest_byte]) + bytes([3, 4, 5])


def order_one(client: int, ts: int, rid: int = 1) -> bytes:
    pp = pre_prepare(client=client) if rid else b""  # the primary proposes by itself
    return request(client, ts) + pp + quorum(False, 0, 1, rid) + quorum(True, 0, 1, rid)


def seeds() -> dict[str, bytes]:
    s: dict[str, bytes] = {}
    for rid in range(4):
        for ext in (0, 4):
            cfg = bytes([rid | ext])
            s[f"order-r{rid}-{'ext' if ext else 'echo'}"] = cfg + order_one(0, 1, rid) + tick(3)
    s["primary-requests"] = (
        b"\x00"
        + b"".join(request(c, 1, b"op", c) for c in range(4))
        + (tick(1) + quorum(False, 0, 1, 0) + quorum(True, 0, 1, 0) + tick(4))
    )
    s["ckpt-stable"] = (
        b"\x01" + b"".join(order_one(i % 4, i) for i in range(4)) + (quorum_checkpoint(1) + tick(5))
    )
    s["view-change"] = (
        b"\x01"
        + tick(6)
        + tick(6)
        + bytes([VIEW_CHANGE, 2, 1, 2, 0, 0])
        + (bytes([2, 2]) + bytes([VIEW_CHANGE, 3, 1, 2, 0, 0, 3, 3]))
        + bytes([NEW_VIEW, 1, 0x1F, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        + tick(3)
    )
    s["view-change-primary"] = (
        b"\x01"
        + tick(6)
        + bytes([VIEW_CHANGE, 2, 1, 2, 0, 0, 1, 2, VIEW_CHANGE, 3, 1, 2, 0, 0, 1, 3])
        + tick(3)
    )
    s["exec-reports"] = (
        b"\x05"
        + order_one(0, 1)
        + bytes([EXEC_REPORT, 0, 0x40 + 4, 1, 0, 1, 3, 0, 1, 0])
        + bytes([EXEC_REPORT, 1, 0x40 + 4, 1, 0, 1, 4, 0, 1, 1])
        + tick(5)
        + tick(5)
    )
    s["fault-round"] = (
        b"\x05"
        + order_one(0, 1)
        + tick(6)
        + bytes([WAKEUP, 2, 0x40 + 4, 0, 3, 0x24, 0, 0x24, 0, 0x24, 0, 0x4, 0x4, 0])
        + bytes([SHUTDOWN, 2, 0x40 + 4, 0x6, 0x1, 0x0, 0x6, 0])
        + bytes([SPARE, 0, 0, 1, 6, 9, 0])
        + tick(5)
    )
    s["exec-checkpoint"] = (
        b"\x06"
        + order_one(1, 2)
        + bytes([EXEC_CHECKPOINT, 0, 1, 2, 0, EXEC_CHECKPOINT, 1, 1, 2, 1])
        + tick(4)
    )
    s["fetch"] = (
        b"\x02"
        + order_one(0, 1)
        + bytes(
            [
                FETCH,
                0,
                1,
                0,
                1,
                1,
                0,
                FETCH,
                1,
                3,
                0x40,
                0,
                1,
                0,
                FETCH_REPLY,
                0,
                0,
                0,
                0,
                1,
                0,
                FETCH_REPLY,
                0,
                1,
                0,
                1,
                0,
            ]
        )
    )
    s["status"] = b"\x03" + bytes([STATUS, 0, 0x82, 0x45, 2, 1, 0]) + tick(3) + tick(4)
    s["conns"] = (
        b"\x00"
        + request(0, 1, b"a", 0)
        + bytes([CLOSE, 0])
        + request(0, 2, b"b", 5)
        + bytes([RAW, 15])
        + b"\x00\x00\x00\xff" * 3
        + bytes([0, REPLAY, 0x2A, MUTATE, 200, 5, 0, 3, 0])
        + tick(7)
    )
    s["partial-frames"] = (
        b"\x01"
        + request(1, 1, b"p", 6 * 5 + 1)[:-1]
        + bytes([6 * 5 + 1, 9, 0, 4])
        + request(2, 1, b"q", 6 * 6 + 2)
        + request(3, 1, b"r", 6 * 7 + 3)
        + bytes([0, 0])
        + tick(7)
    )
    return s


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, data in seeds().items():
        (out / f"seed-{name}").write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
