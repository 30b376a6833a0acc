# execution/storelock.py - one checkpoint-store operation at a time, execution's first.
"""The lock a runtime's checkpoint store is used under, with two kinds of holders.

The store is not safe for concurrent use, so a checkpoint, an install, a collection of old
snapshots and a file served to a recovering peer take turns. They are not equal: the
report of a checkpoint seq waits for its checkpoint (the digest is in the report), and an
agreement replica convicts a replica whose report is later than its timer (ZZ TR §9,
Definition 1). A plain FIFO lock put a checkpoint behind whatever was queued first: a
collection of every snapshot a closed fault round had held (each destroy is a directory
tree removed: 0.2-0.4 s for 300 files at load 13 on 2 cores) and the file reads of a
peer's recovery. In the adversarial campaign (seed 3802, f = 2, rounds 82 and 89) a
correct replica's report of a checkpoint seq came just after the 4 s timer that way, while
the recovering peer it served reported on time, and it was convicted.

`urgent()` is for what a report waits on (a checkpoint, the install of a recovery); it
goes before every `background()` holder not yet running, so it waits for at most the one
operation in progress. Background work (serving a file, collecting a snapshot) is done in
small operations, each taking the lock anew.

The second half of a directory-store checkpoint (linking its unchanged files from the base
and listing it, execution/checkpointing.py) runs after the lock is let go, as a
**completion** (`begin_completion`/`end_completion`): every holder that changes the store
(`urgent()`, a `background()` collection) waits for it after taking the lock, and a
reader (`background(..., reads=True)`, a file served to a recovering peer) does not: it
reads other snapshots than the one being completed, and a woken spare fetches its files
right when the active replicas complete the checkpoint of the fault's seq.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

log = logging.getLogger("zz.execution")
# An urgent holder that waited longer than this says so, naming what held the lock.
SLOW_WAIT_S = 1.0


class StoreLock:
    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._urgent = 0  # urgent holders waiting or holding
        self._no_urgent = asyncio.Event()
        self._no_urgent.set()
        # Seconds: the longest an urgent holder waited, and the longest hold of each kind.
        self.stats: dict[str, float] = {
            "urgent_wait_max_s": 0.0,
            "urgent_hold_max_s": 0.0,
            "background_hold_max_s": 0.0,
        }
        self.holder = ""  # what holds it now (for a log line about a long wait)
        self._completed = asyncio.Event()  # no completion runs
        self._completed.set()
        self.stats["completion_max_s"] = 0.0
        self._completion_t0 = 0.0

    def locked(self) -> bool:
        return self._lock.locked()

    @asynccontextmanager
    async def urgent(self, what: str) -> AsyncIterator[float]:
        """Hold the lock before any background holder still waiting; yields the seconds
        it waited."""
        self._urgent += 1
        self._no_urgent.clear()
        t0 = time.monotonic()
        blocker = self.holder
        try:
            async with self._lock:
                waited = time.monotonic() - t0
                self._note("urgent_wait_max_s", waited)
                if waited > SLOW_WAIT_S:
                    log.warning(
                        "%s waited %.2f s for the store (held by %s)",
                        what,
                        waited,
                        blocker or "nothing when it asked",
                    )
                await self._completed.wait()
                waited = time.monotonic() - t0
                async with self._held(what, "urgent_hold_max_s"):
                    yield waited
        finally:
            self._urgent -= 1
            if self._urgent == 0:
                self._no_urgent.set()

    @asynccontextmanager
    async def background(self, what: str, reads: bool = False) -> AsyncIterator[None]:
        """Hold the lock when no urgent holder waits for it; `reads`: the holder only
        reads snapshots, and does not wait for a completion."""
        while True:
            await self._no_urgent.wait()
            await self._lock.acquire()
            if self._urgent == 0:
                break
            # An urgent holder came while this one queued: it goes first.
            self._lock.release()
        try:
            if not reads:
                await self._completed.wait()
            async with self._held(what, "background_hold_max_s"):
                yield
        finally:
            self._lock.release()

    def begin_completion(self) -> None:
        """Called with the lock held: what follows until end_completion() may run after
        the lock is let go, and every holder that changes the store waits for it."""
        assert self._lock.locked() and self._completed.is_set()
        self._completed.clear()
        self._completion_t0 = time.monotonic()

    def end_completion(self) -> None:
        self._note("completion_max_s", time.monotonic() - self._completion_t0)
        self._completed.set()

    @asynccontextmanager
    async def _held(self, what: str, stat: str) -> AsyncIterator[None]:
        self.holder = what
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._note(stat, time.monotonic() - t0)
            self.holder = ""

    def _note(self, stat: str, seconds: float) -> None:
        if seconds > self.stats[stat]:
            self.stats[stat] = round(seconds, 4)

    def status(self) -> dict[str, Any]:
        return dict(self.stats)
