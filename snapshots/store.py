# snapshots/store.py - the one storage interface for a replica's checkpointed state directory.
# Backends (zfs.py: OpenZFS CLI, dirstore.py: plain directory) implement it; open_store() picks.
"""CheckpointStore: live state directory plus named, immutable snapshots of it.

Invariants every backend keeps:

* ``path`` is the live directory the application writes; it exists while the store does.
* A snapshot captures ``path`` as it was when ``snapshot()`` returned; later writes to
  ``path`` never show through it.
* Snapshot names are plain tokens (``ckpt-16``): a letter or digit, then letters, digits
  and ``_ - . :``, so they are valid ZFS snapshot names and safe as file names.
* ``list_snapshots()`` returns names in creation order (oldest first).
"""

from __future__ import annotations

import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from zz.snapshots.crashpoint import crash_point

_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}")


class StorageError(Exception):
    """A storage operation failed; carries the command (argv) and its stderr when there is one."""

    def __init__(self, message: str, command: Sequence[str] = (), stderr: str = "") -> None:
        self.command = list(command)
        self.stderr = stderr
        detail = f": {stderr.strip()}" if stderr.strip() else ""
        where = f" ({' '.join(self.command)})" if self.command else ""
        super().__init__(f"{message}{where}{detail}")


def checkpoint_name(seq: int) -> str:
    """Snapshot name for the checkpoint at sequence number ``seq`` (docs/design.md §4.2)."""
    if seq < 0:
        raise ValueError(f"checkpoint sequence number must be >= 0, got {seq}")
    return f"ckpt-{seq}"


def check_snapshot_name(name: str) -> str:
    """Return ``name`` if it is a valid snapshot name, else raise ValueError."""
    if not _SNAPSHOT_NAME.fullmatch(name):
        raise ValueError(
            f"bad snapshot name {name!r}: a letter or digit, then letters, digits, _ - . : only"
        )
    return name


class CheckpointStore(ABC):
    """One replica's state directory and its snapshots."""

    @property
    @abstractmethod
    def path(self) -> Path:
        """The live directory the application writes."""

    @abstractmethod
    def snapshot(self, name: str) -> None:
        """Capture the live directory as snapshot ``name``; an existing name is an error."""

    @abstractmethod
    def list_snapshots(self) -> list[str]:
        """Names of the existing snapshots, oldest first."""

    @abstractmethod
    def destroy_snapshot(self, name: str) -> None:
        """Delete snapshot ``name``; a missing name is an error."""

    # True where snapshot_since does better than snapshot (worth finding a base for).
    shares_unchanged = False

    def snapshot_since(self, name: str, base: str, unchanged: Callable[[str], bool]) -> None:
        """:meth:`snapshot`, told that the files whose relative paths `unchanged` accepts
        hold what they held in snapshot `base`: a backend that copies may share those
        with `base` instead. Here it is a plain snapshot."""
        self.snapshot(name)

    def stage_since(
        self,
        name: str,
        base: str,
        files: Iterable[str],
        unchanged: Callable[[str], bool],
        content: Mapping[str, bytes] | None = None,
    ) -> Callable[[], None] | None:
        """:meth:`snapshot_since` in two halves, where a backend can part them: this call
        reads what it needs of the live directory (`files` is every file of the state, as
        its manifest lists them; those `unchanged` accepts must be in `base` as they are
        live) and returns the second half, which completes and lists snapshot `name` from
        `base` and what the first half copied alone, so it may run while the live
        directory is written again. None where the backend cannot (or `base` is gone):
        the caller takes the snapshot in one step. `content`: the live bytes of some
        files, as the manifest hashed them, which the copy may take instead of reading
        the file again."""
        return None

    def detach_snapshot(self, name: str) -> Callable[[], None]:
        """Delete snapshot ``name`` from the store now (as :meth:`destroy_snapshot`); the
        callable returned frees what it still holds, and may run later, while other
        operations use the store (a directory copy takes long to remove). Here it is all
        done at once."""
        self.destroy_snapshot(name)
        return _nothing

    @abstractmethod
    def open_snapshot(self, name: str) -> AbstractContextManager[Path]:
        """Context manager yielding a directory with the snapshot's content.

        Read it only; whatever the backend had to create for it (a ZFS clone) is removed
        on exit, also when the body raises.
        """

    def recover(self) -> list[str]:
        """Finish or undo whatever a crash interrupted (docs/checkpoints.md "Crash
        consistency"), so that every listed snapshot is complete and nothing half made is
        left under a snapshot's name. Only the store's one writer (the runtime, at start,
        before anything else) calls it; a reader (controld) never does. Returns what it
        removed. Backends whose every step is atomic (ZFS) have nothing to do."""
        return []

    def restore_live(self, name: str) -> None:
        """Make the live directory exactly snapshot ``name`` again (a restart drops what
        was written after the last checkpoint). Generic: empty it and copy the snapshot
        in; ZFS overrides this with an O(1) ``zfs rollback``."""
        live = self.path
        for child in list(live.iterdir()):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        crash_point("store.restore.emptied")  # a restart empties and copies again
        with self.open_snapshot(name) as snap:
            shutil.copytree(snap, live, dirs_exist_ok=True, symlinks=True)

    @abstractmethod
    def destroy(self) -> None:
        """Remove the live directory and every snapshot of it."""


def _nothing() -> None:
    pass
