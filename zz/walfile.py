# zz/walfile.py - zz-agreed's write-ahead log files as the tests and the power-loss tool see
# them: walk the records by their framing, find the current file, damage it on purpose.
"""Durable agreement state on disk (docs/agreement.md "Durable state"; agreement/src/wal.h).

Each record: ``u32 len`` (type and body), ``u32 crc``, ``u32 epoch`` (the file's), ``u8
type``, body. A data directory holds two files, ``wal-a`` and ``wal-b``; the one with the
higher epoch is current. Nothing here checks a CRC: it walks the framing the way wal.c does
(a zero length or a record of another epoch ends the log), which is what is needed to
find a record's offset and cut or flip it. wal.c alone decides what is valid.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

HDR = 12  # u32 len, u32 crc, u32 epoch
HEADER, STABLE, VIEW, SLOT, SNAPEND, XSTABLE, XENTRY = 1, 2, 3, 4, 5, 6, 7
FILES = ("wal-a", "wal-b")
# HEADER body, version 2: u32 version, u16 service, u32 id, u32 n, u64 abstain, u8[16] boot,
# u32 lost view, u64 lost seq
BOOT_AT = 4 + 2 + 4 + 4 + 8
BOOT_LEN = 16


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli, reflected 0x82F63B78), as wal.c computes it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


@dataclass(frozen=True)
class Record:
    offset: int
    length: int  # framing included
    type: int


def records(path: Path) -> tuple[int, list[Record]]:
    """The epoch of a log file and its records, walked by their framing (a zero length or
    another epoch ends it). (0, []) for a file too short to hold one."""
    data = path.read_bytes()
    if len(data) < HDR:
        return 0, []
    epoch = int.from_bytes(data[8:12], "big")
    out, off = [], 0
    while off + HDR < len(data):
        n = int.from_bytes(data[off : off + 4], "big")
        if n == 0 or int.from_bytes(data[off + 8 : off + 12], "big") != epoch:
            break
        out.append(Record(off, HDR + n, data[off + HDR]))
        off += HDR + n
    return epoch, out


def current_log(data_dir: Path) -> Path | None:
    """The file of `data_dir` with the higher epoch (the one a restart replays), or None."""
    files = [data_dir / name for name in FILES if (data_dir / name).exists()]
    files = [f for f in files if f.stat().st_size >= HDR]
    if not files:
        return None
    return max(files, key=lambda f: records(f)[0])


def after_rewrite(recs: list[Record]) -> list[Record]:
    """The records appended after the file's rewrite (after its SNAPEND): the ones a
    damage can hit without making the whole file unusable."""
    types = [r.type for r in recs]
    if SNAPEND not in types:
        return []
    return recs[types.index(SNAPEND) + 1 :]


@dataclass(frozen=True)
class Damage:
    kind: str  # "torn", "torn-rewrite" (a write cut short), "bitflip" (a synced record changed)
    path: Path
    offset: int  # of the damaged record: where zz-agreed must say the damage is
    detail: str


def tear(path: Path) -> Damage | None:
    """Cut the file inside its last record, as a write the crash interrupted (its sync had
    not returned). Kind "torn" when that record follows the file's rewrite: zz-agreed must
    report a torn tail at its offset; "torn-rewrite" when nothing follows the rewrite yet
    (a crash while the file was being rewritten): the file is incomplete, and zz-agreed must
    say so and recover from the other file (or from nothing). None for a file without
    records."""
    _epoch, recs = records(path)
    tail = after_rewrite(recs)
    if not recs:
        return None
    last = (tail or recs)[-1]
    with path.open("r+b") as f:
        f.truncate(last.offset + last.length // 2)
    return Damage("torn" if tail else "torn-rewrite", path, last.offset,
                  f"cut at byte {last.length // 2} of the last record (type {last.type},"
                  f" {last.length} bytes at offset {last.offset})")  # fmt: skip


def flip(path: Path, rng: random.Random) -> Damage | None:
    """Flip one bit inside a record that has a record after it (both after the file's
    rewrite): a synced record changed on disk, which zz-agreed must report as a corrupt
    tail at that record's offset. None when fewer than two records follow the rewrite."""
    _epoch, recs = records(path)
    tail = after_rewrite(recs)
    if len(tail) < 2:
        return None
    rec = tail[rng.randrange(len(tail) - 1)]
    # A byte of the body (after the framing and the type byte): the CRC catches it.
    at = rec.offset + HDR + 1 + rng.randrange(max(1, rec.length - HDR - 1))
    at = min(at, rec.offset + rec.length - 1)
    bit = rng.randrange(8)
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << bit)]))
    return Damage("bitflip", path, rec.offset,
                  f"bit {bit} of byte {at} flipped, in a record of type {rec.type}"
                  f" ({rec.length} bytes at offset {rec.offset}), {len(tail)} records"
                  f" after the rewrite")  # fmt: skip


def as_if_rebooted(path: Path) -> bool:
    """Give the file's header another boot id (each byte inverted), its checksum
    recomputed: the file then looks written before the host restarted, as after a power
    cut (a killed process keeps its boot). False, nothing changed, for a file whose first
    record is not a version-2 header (version 1 names no boot)."""
    data = bytearray(path.read_bytes())
    if len(data) < HDR + 1 + BOOT_AT + BOOT_LEN:
        return False
    length = int.from_bytes(data[0:4], "big")
    if data[HDR] != HEADER or int.from_bytes(data[HDR + 1 : HDR + 5], "big") != 2:
        return False
    at = HDR + 1 + BOOT_AT
    data[at : at + BOOT_LEN] = bytes(b ^ 0xFF for b in data[at : at + BOOT_LEN])
    # the checksum covers the length, the epoch, the type and the body
    data[4:8] = crc32c(bytes(data[0:4]) + bytes(data[8 : HDR + length])).to_bytes(4, "big")
    with path.open("r+b") as f:
        f.write(bytes(data[: HDR + length]))
    return True
