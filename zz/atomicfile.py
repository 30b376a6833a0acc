"""zz/atomicfile.py - replace a file in one step.

Status files, fault files, inventories and ledgers are read by other processes (and other
hosts' guests, through a share) while they are rewritten: a reader must see the old
content or the new, never a torn file. The new content goes to a hidden temporary file
beside the target, which then replaces it (rename(2) is atomic within a file system)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_atomic(
    path: Path | str,
    data: bytes | str,
    *,
    durable: bool = False,
    mode: int = 0o644,
    owner: str | None = None,
) -> None:
    """Write `data` to `path` atomically. `durable`: also survive a host crash (the file
    and then its directory are fsynced), for records a daemon restarts from. `mode`: the
    new file's permissions (a secret key: 0o600, never readable by others, not even
    briefly). `owner`: a user (and group of that name) the new file belongs to before it
    takes `path`'s place, so that a reader running as that user never finds it unreadable.
    On an error the temporary file is removed and the old `path` is left as it was. The
    temporary name carries the pid: several daemons may replace one file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        if owner is not None:
            shutil.chown(tmp, owner, owner)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
