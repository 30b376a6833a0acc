# controld/reset.py - what `zz rack down` removes on a host whose controld runs there
# (rack.controlds = "hosts"): the rack's execution and agreement state of this host, so that a
# next `zz rack up` starts from seq 0 and meets no replica that remembers a later one.
"""The files and datasets op `reset` removes (docs/controld.md "RPC", op `reset`).

On a rack on one machine `zz rack down` removes these itself (zz/rackctl.py) and destroys the
pools; with controlds on their hosts the operator's machine holds none of them, and the pool
is the host's (made by `zz host init`), so controld removes, for the slots and agreement
replicas the config places on its host:

* each execution replica's state directory `run/s<id>/exec-<i>/` and, on ZFS, its dataset
  (`<pool>/s<id>-exec-<i>`, or the next free name a guest's got: `...-<n>`, with its
  snapshots and the clones of them);
* each agreement replica's view of the execution replicas (`agreed-<r>.exec-view`) and its
  write-ahead log (`agreed-<r>.data/`);
* with `purge_forensics`, the convicted replicas' kept states (directories and datasets);
  otherwise they are listed as kept.

Logs, stats and status files, the audit log and the keys stay, as `down` keeps them on one
machine. Every path is built from the config and checked to lie inside `run_dir`; a
symlink is unlinked, never followed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from zz.config import Config, Service
from zz.snapshots.zfs import run_zfs


def _inside(path: Path, root: Path) -> Path | None:
    """`path` with its parent resolved, if that lies strictly inside `root`."""
    real_root = root.resolve()
    target = path.parent.resolve() / path.name
    if target == real_root or not target.is_relative_to(real_root):
        return None
    return target


def _remove(path: Path, root: Path, deleted: list[str], refused: list[str]) -> None:
    target = _inside(path, root)
    if target is None:
        refused.append(f"{path}: not inside {root}")
        return
    if not (target.exists() or target.is_symlink()):
        return
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    else:
        target.unlink()
    deleted.append(str(path))


def slot_dataset_pattern(svc: Service, index: int) -> re.Pattern[str]:
    """A slot's live dataset (not a forensic one, not a reader's clone): s<id>-exec-<i>,
    or -<n> after it when a guest's dataset had to take the next free name."""
    return re.compile(rf"s{svc.id}-exec-{index}(?:-\d+)?")


def forensic_dataset_pattern(svc: Service, index: int) -> re.Pattern[str]:
    return re.compile(rf"s{svc.id}-exec-{index}(?:-\d+)?-forensic-\d+(?:-\d+)?")


def clear(
    config: Config,
    slots: list[tuple[Service, int]],
    agreed: list[tuple[Service, int]],
    zfs_pool: str | None,
    purge_forensics: bool,
) -> dict[str, list[str]]:
    """Remove the state of `slots` (execution replicas placed here) and `agreed` (agreement
    replicas placed here); returns `deleted`, `kept` (forensic states) and `refused`
    (paths outside run_dir, datasets ZFS would not destroy)."""
    run = config.rack.run_dir
    deleted: list[str] = []
    kept: list[str] = []
    refused: list[str] = []
    if zfs_pool:
        names = run_zfs(["zfs", "list", "-H", "-o", "name", "-t", "filesystem", "-r", zfs_pool])
        for name in names.split():
            leaf = name.rsplit("/", 1)[-1]
            if "/" not in name or "--" in leaf:
                continue  # the pool itself; a reader's clone goes with its origin (-R)
            for svc, i in slots:
                forensic = forensic_dataset_pattern(svc, i).fullmatch(leaf)
                if forensic and not purge_forensics:
                    kept.append(f"ZFS dataset {name}")
                elif forensic or slot_dataset_pattern(svc, i).fullmatch(leaf):
                    try:
                        run_zfs(["zfs", "destroy", "-R", name], retry_busy=True)
                        deleted.append(f"ZFS dataset {name}")
                    except Exception as e:  # StorageError: busy (docs/design.md §9)
                        refused.append(f"ZFS dataset {name}: {e}")
    for svc, i in slots:
        base = run / f"s{svc.id}"
        _remove(svc.exec_state_dir(config, i), run, deleted, refused)
        for d in sorted(base.glob(f"exec-{i}.forensic-*")) if base.is_dir() else []:
            if purge_forensics:
                _remove(d, run, deleted, refused)
            else:
                kept.append(str(d))
    for svc, r in agreed:
        base = run / f"s{svc.id}"
        _remove(base / f"agreed-{r}.exec-view", run, deleted, refused)
        _remove(base / f"agreed-{r}.data", run, deleted, refused)
    return {"deleted": deleted, "kept": kept, "refused": refused}
