"""zz/naming.py - the names a rack gives an execution replica outside its own process: the
libvirt domain (controld, zz rack, zz drill) and the ZFS dataset of its state (the runtime's
default, controld's guest datasets and snapshots)."""

from __future__ import annotations

from zz.config import Config, Service


def domain_name(config: Config, service: Service, index: int) -> str:
    return f"zz-{config.rack.name}-{service.name}-x{index}"


def zfs_dataset(service: Service, index: int) -> str:
    """The runtime's default dataset name (python -m zz.execution --zfs-dataset)."""
    return f"s{service.id}-exec-{index}"
