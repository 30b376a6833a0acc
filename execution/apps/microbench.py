"""execution/apps/microbench.py - requests that burn a chosen CPU time E, for execution benchmarks.
The op carries the work as SHA-256 iterations, so every correct replica returns the same hash."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from hashlib import sha256

from zz.execution.app import App, ExecContext
from zz.execution.state import ReadOnlyStateError

# Op header (docs/apps.md "microbench"), then a payload that only pads the request.
_HDR = struct.Struct(">BIIHI")
UNIT_ITERATIONS = 0
UNIT_MICROSECONDS = 1
STATUS_OK = 0
STATUS_ERROR = 1
DATA_DIR = "mb"


class MicrobenchError(ValueError):
    """A malformed microbench op or reply."""


@dataclass(frozen=True)
class BenchOp:
    unit: int
    amount: int
    reply_size: int = 0  # 0: the 32-byte final hash
    writes: int = 0  # state files written per request
    write_size: int = 0  # bytes per written file
    payload: bytes = b""

    def encode(self) -> bytes:
        return (
            _HDR.pack(self.unit, self.amount, self.reply_size, self.writes, self.write_size)
            + self.payload
        )


def encode_op(
    *,
    iterations: int | None = None,
    us: int | None = None,
    reply_size: int = 0,
    writes: int = 0,
    write_size: int = 0,
    payload: bytes = b"",
) -> bytes:
    """Build an op with exactly one of `iterations` or `us` (converted by the replicas
    through the rack-wide `iters_per_ms` option, never through a local measurement)."""
    if (iterations is None) == (us is None):
        raise ValueError("give exactly one of iterations= or us=")
    unit, amount = (UNIT_ITERATIONS, iterations) if us is None else (UNIT_MICROSECONDS, us)
    return BenchOp(unit, int(amount), reply_size, writes, write_size, payload).encode()


def decode_op(data: bytes) -> BenchOp:
    if len(data) < _HDR.size:
        raise MicrobenchError(
            f"op of {len(data)} bytes is shorter than the {_HDR.size}-byte header"
        )
    unit, amount, reply_size, writes, write_size = _HDR.unpack_from(data)
    if unit not in (UNIT_ITERATIONS, UNIT_MICROSECONDS):
        raise MicrobenchError(f"unknown unit {unit}")
    return BenchOp(unit, amount, reply_size, writes, write_size, bytes(data[_HDR.size :]))


def decode_reply(data: bytes) -> bytes:
    """The reply bytes of a successful op, or MicrobenchError carrying the replica's message."""
    if not data:
        raise MicrobenchError("empty reply")
    if data[0] == STATUS_OK:
        return bytes(data[1:])
    if data[0] == STATUS_ERROR:
        raise MicrobenchError(data[1:].decode("utf-8", "replace"))
    raise MicrobenchError(f"unknown reply status {data[0]}")


def burn(seed: bytes, iterations: int) -> bytes:
    """Iterate SHA-256 from `seed`: the deterministic unit of work."""
    h = sha256(seed).digest()
    for _ in range(iterations):
        h = sha256(h).digest()
    return h


def expand(h: bytes, size: int, label: bytes = b"") -> bytes:
    """`size` deterministic bytes derived from `h` (SHA-256 in counter mode)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += sha256(h + label + counter.to_bytes(8, "big")).digest()
        counter += 1
    return bytes(out[:size])


def calibrate(duration_s: float = 0.25) -> float:
    """SHA-256 iterations per millisecond on this machine, for a benchmark choosing counts.

    Measurement only: replicas never use it to convert µs (they would disagree), the
    benchmark passes the result as the rack-wide `iters_per_ms` option or as counts.
    """
    chunk = 2000
    done = 0
    h = b"zz-calibrate"
    start = time.perf_counter()
    elapsed = 0.0
    while elapsed < duration_s or done == 0:
        h = burn(h, chunk)
        done += chunk
        elapsed = time.perf_counter() - start
    return done / (elapsed * 1000.0)


class MicrobenchApp(App):
    name = "microbench"

    def __init__(
        self,
        iters_per_ms: int = 1000,
        files: int = 1024,
        max_iterations: int = 100_000_000,
        max_reply: int = 1 << 20,
        max_write: int = 1 << 20,
        max_writes: int = 64,
    ) -> None:
        self.iters_per_ms = iters_per_ms
        self.files = files
        self.max_iterations = max_iterations
        self.max_reply = max_reply
        self.max_write = max_write
        self.max_writes = max_writes

    def is_read_only(self, op: bytes) -> bool:
        try:
            return decode_op(op).writes == 0
        except MicrobenchError:
            return True  # the error reply writes nothing

    def iterations(self, op: BenchOp) -> int:
        if op.unit == UNIT_ITERATIONS:
            return op.amount
        # Integer arithmetic so that no replica rounds differently.
        return op.amount * self.iters_per_ms // 1000

    def _check(self, op: BenchOp, iterations: int) -> str | None:
        if iterations > self.max_iterations:
            return f"{iterations} iterations over the limit {self.max_iterations}"
        if op.reply_size > self.max_reply:
            return f"reply_size {op.reply_size} over the limit {self.max_reply}"
        if op.writes > self.max_writes:
            return f"writes {op.writes} over the limit {self.max_writes}"
        if op.write_size > self.max_write:
            return f"write_size {op.write_size} over the limit {self.max_write}"
        return None

    def execute(self, op: bytes, ctx: ExecContext) -> bytes:
        try:
            req = decode_op(op)
        except MicrobenchError as e:
            return bytes([STATUS_ERROR]) + str(e).encode()
        n = self.iterations(req)
        problem = self._check(req, n)
        if problem is None and req.writes and ctx.read_only:
            problem = "a request with writes cannot run read-only"
        if problem is not None:
            return bytes([STATUS_ERROR]) + problem.encode()
        h = burn(op, n)
        try:
            self._write(req, ctx, h)
        except ReadOnlyStateError as e:
            return bytes([STATUS_ERROR]) + str(e).encode()
        reply = h if req.reply_size == 0 else expand(h, req.reply_size, b"reply")
        return bytes([STATUS_OK]) + reply

    def _write(self, req: BenchOp, ctx: ExecContext, h: bytes) -> None:
        # Slots come from the request identity (requests of one batch share seq), so
        # every replica overwrites the same files and the working set stays `files`.
        ident = struct.pack(">QQQ", ctx.seq, ctx.client, ctx.timestamp)
        for i in range(req.writes):
            slot = int.from_bytes(sha256(ident + i.to_bytes(4, "big")).digest()[:8], "big")
            path = f"{DATA_DIR}/{slot % self.files:06d}"
            self.state.write_bytes(path, expand(h, req.write_size, b"file%d" % i))
