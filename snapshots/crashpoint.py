# snapshots/crashpoint.py - TEST-ONLY crash points in the checkpoint and recovery paths.
# Production never sets the variables below; crash_point() is then one global check.
"""Named crash points, for tests that kill a replica between two on-disk steps.

``crash_point("dirstore.snapshot.renamed")`` marks a point between two steps of a
multi-step on-disk change (docs/checkpoints.md "Crash consistency"). It does nothing unless
a test set, before the process started:

* ``ZZ_CRASH_AT=<name>:<k>``: the k-th time (1-based) point ``name`` is reached, the
  process SIGKILLs itself (no cleanup, no ``finally``, no flush: like a power cut for the
  process, not for the kernel's page cache).
* ``ZZ_CRASH_TRACE=<file>``: every point reached is appended to ``file``, one name a line,
  so a test learns the points of a run and then crashes at each in turn.

``arm(at, trace)`` sets the same two in a process forked after the import.

Test-only. Not for drills or operators: a replica killed this way is a crash fault.
``set_hook(fn)`` replaces both for in-process tests (``None`` puts the environment back).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable

_AT = os.environ.get("ZZ_CRASH_AT")
_TRACE = os.environ.get("ZZ_CRASH_TRACE")
_hits: Counter[str] = Counter()
_hook: Callable[[str], None] | None = None


def _from_env(name: str) -> None:
    _hits[name] += 1
    if _TRACE:
        with open(_TRACE, "a") as f:
            f.write(name + "\n")
    if _AT and _AT == f"{name}:{_hits[name]}":
        os.kill(os.getpid(), signal.SIGKILL)


if _AT or _TRACE:
    _hook = _from_env


def crash_point(name: str) -> None:
    """Between two on-disk steps: a no-op unless a test armed it (module docstring)."""
    if _hook is not None:
        _hook(name)


def arm(at: str | None, trace: str | None) -> None:
    """Test-only: as if ``ZZ_CRASH_AT``/``ZZ_CRASH_TRACE`` had been set when the process
    started, for a child forked from a process that imported this module unarmed."""
    global _AT, _TRACE, _hook
    _AT, _TRACE = at, trace
    _hits.clear()
    _hook = _from_env if at or trace else None


def set_hook(fn: Callable[[str], None] | None) -> None:
    """Test-only: call ``fn(name)`` at every crash point (None: back to the environment)."""
    global _hook
    _hook = fn if fn is not None else (_from_env if _AT or _TRACE else None)
