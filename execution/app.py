"""execution/app.py - the application interface an execution replica drives (docs/apps.md).
Apps see only ordered ops, agreement-chosen inputs and a StateDir, so all replicas agree."""

from __future__ import annotations

import random
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from hashlib import sha256

from zz.execution.state import StateDir


@dataclass(frozen=True)
class ExecContext:
    """Everything about one request that is not the op itself; the same on all replicas.

    seq        agreement sequence number of the batch holding the request
    client     client principal id
    timestamp  the client's request timestamp (exactly-once counter, not a clock)
    time_ms    agreement-chosen time for the batch, ms since the Unix epoch (nd_time)
    seed       agreement-chosen random seed for the batch (nd_seed)
    read_only  the request runs unordered (PBFT read-only optimization): it must not
               change state, and the StateDir refuses writes while it runs
    """

    seq: int
    client: int
    timestamp: int
    time_ms: int
    seed: int
    read_only: bool = False

    def rng(self) -> random.Random:
        """A random.Random that every replica seeds identically for this request.

        Requests of one batch share `seed`, so (seq, client, timestamp) is mixed in to
        give each request its own stream. random.Random(int) seeding is stable across
        CPython versions, unlike seeding from str or from os.urandom.
        """
        material = struct.pack(
            ">QQQQ",
            self.seed & 0xFFFFFFFFFFFFFFFF,
            self.seq & 0xFFFFFFFFFFFFFFFF,
            self.client & 0xFFFFFFFFFFFFFFFF,
            self.timestamp & 0xFFFFFFFFFFFFFFFF,
        )
        return random.Random(int.from_bytes(sha256(b"zz-rng\x00" + material).digest(), "big"))


class App(ABC):
    """A deterministic replicated application.

    Life cycle, driven by the execution runtime:
      app = factory(options); app.open(state)
      [app.load_memory(data)   when recovering from a checkpoint that saved memory]
      app.execute(op, ctx) ... in sequence-number order
      state.sync(); app.save_memory() at every checkpoint

    Contract: execute() returns the same bytes on every correct replica given the same
    state files, memory, op and ctx. It must not read clocks, os.urandom, the
    environment, or the network; it must encode malformed ops as an error *reply*
    (an exception means the replica cannot go on, which the runtime treats as a
    fault). Everything it keeps lives in state files or in save_memory().
    """

    name: str = "app"
    # Every file of the app's state is only ever replaced whole (StateDir.write_bytes),
    # never written in part or opened for writing: a replayed run of certified batches
    # may then keep the writes in memory and write each file once (StateDir.buffer_writes).
    buffers_writes: bool = False
    state: StateDir  # set by open(); apps touch files only through it

    def open(self, state: StateDir) -> None:  # noqa: B027 - optional hook, no-op default
        """Attach the state directory at start or recovery; may read existing files."""
        self.state = state

    @abstractmethod
    def execute(self, op: bytes, ctx: ExecContext) -> bytes:
        """Apply one ordered (or read-only) request and return the reply bytes."""

    def is_read_only(self, op: bytes) -> bool:
        """Whether `op` may run unordered (it never writes); clients and proxies ask."""
        return False

    def save_memory(self) -> bytes | None:
        """In-memory state to store as a checkpoint file, or None if all state is in files."""
        return None

    def load_memory(self, data: bytes) -> None:
        """Restore what save_memory() returned at the checkpoint being recovered."""
        if data:
            raise ValueError(f"app {self.name!r} keeps no memory state, got {len(data)} bytes")


class EchoApp(App):
    """The null service: the reply is the op. Touches no state, so checkpoints are empty."""

    name = "echo"

    def execute(self, op: bytes, ctx: ExecContext) -> bytes:
        return bytes(op)

    def is_read_only(self, op: bytes) -> bool:
        return True
