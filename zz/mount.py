"""zz/mount.py - `zz mount`: a FUSE file system whose every operation is a BFT request to a
service running the files app (docs/files.md). Replies count only with their certificate (f+1
matching REPLYs, zz.client); pyfuse3 (libfuse 3) in asyncio mode talks to the kernel."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
from dataclasses import dataclass

import pyfuse3
import pyfuse3.asyncio

from zz import fsop
from zz.client import ClientTimeout, RequestTooLarge
from zz.config import Config
from zz.mountpoints import MountError, mounted_zz
from zz.proxy import ClientPool

log = logging.getLogger("zz.mount")

CHUNK = 128 * 1024  # bytes per READ or WRITE request (the kernel's usual max_write)
READDIR_PAGE = 1024


@dataclass(frozen=True)
class MountOptions:
    timeout: float = 30.0  # seconds per operation, then ETIMEDOUT
    cache: float = 1.0  # seconds the kernel may keep names and attributes
    allow_other: bool = False
    max_tasks: int = 16  # FUSE requests handled at once


class FsService:
    """The files service through a pool of BFT clients: one op in, a certified reply out."""

    def __init__(self, pool: ClientPool, timeout: float) -> None:
        self.pool = pool
        self.timeout = timeout
        self.stats: dict[str, int] = {"ops": 0, "timeouts": 0, "bad_replies": 0}

    async def call(self, op: bytes) -> fsop.FsReply:
        """The certified reply, or FUSEError: the op's error, ETIMEDOUT when no reply
        certificate arrives within the timeout, EIO for a reply that does not decode."""
        self.stats["ops"] += 1
        code = op[0]
        name = fsop.OP_NAMES[code].lower()
        self.stats[name] = self.stats.get(name, 0) + 1
        try:
            raw = await self.pool.invoke(op, code in fsop.READ_OPS, self.timeout)
        except (ClientTimeout, TimeoutError):
            self.stats["timeouts"] += 1
            log.warning("%s: no certified reply within %.0f s", fsop.OP_NAMES[code], self.timeout)
            raise pyfuse3.FUSEError(errno.ETIMEDOUT) from None
        except RequestTooLarge as e:
            log.warning("%s: %s", fsop.OP_NAMES[code], e)
            raise pyfuse3.FUSEError(errno.EFBIG) from None
        try:
            reply = fsop.decode_reply(code, raw)
        except fsop.FsDecodeError as e:
            self.stats["bad_replies"] += 1
            log.error("%s: certified reply does not decode: %s", fsop.OP_NAMES[code], e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        if not reply.ok:
            if reply.status in (fsop.EPROTO, fsop.EROFS):
                why = reply.data.decode(errors="replace")
                log.error("%s refused: %s", fsop.OP_NAMES[code], why)
            raise pyfuse3.FUSEError(reply.status)
        return reply


class ZzFs(pyfuse3.Operations):
    """FUSE low-level operations over inode numbers, which are the service's own. No state
    is kept here but open directory listings: every answer is the service's."""

    enable_writeback_cache = False

    def __init__(self, service: FsService, options: MountOptions) -> None:
        super().__init__()
        self.svc = service
        self.opts = options
        self._dirs: dict[int, list[fsop.DirEntry]] = {}
        self._next_dh = 1

    def _entry(self, a: fsop.Attr | None) -> pyfuse3.EntryAttributes:
        assert a is not None
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = self.opts.cache
        e.attr_timeout = self.opts.cache
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = a.uid
        e.st_gid = a.gid
        e.st_rdev = 0
        e.st_size = a.size
        e.st_blksize = 4096
        e.st_blocks = (a.size + 511) // 512
        e.st_atime_ns = a.atime_ns
        e.st_mtime_ns = a.mtime_ns
        e.st_ctime_ns = a.ctime_ns
        return e

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        try:
            reply = await self.svc.call(fsop.encode_lookup(parent_inode, name))
        except pyfuse3.FUSEError as e:
            if e.errno != errno.ENOENT or self.opts.cache <= 0:
                raise
            # Inode 0: the kernel keeps the name as absent for the cache time (a create
            # through this mount replaces it at once), sparing programs that probe for
            # files (tar, git) a request per probe.
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = self.opts.cache
            return negative
        return self._entry(reply.attr)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry((await self.svc.call(fsop.encode_getattr(inode))).attr)

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        valid = 0
        for flag, on in (
            (fsop.SET_MODE, fields.update_mode),
            (fsop.SET_UID, fields.update_uid),
            (fsop.SET_GID, fields.update_gid),
            (fsop.SET_SIZE, fields.update_size),
            (fsop.SET_ATIME, fields.update_atime),
            (fsop.SET_MTIME, fields.update_mtime),
        ):
            if on:
                valid |= flag
        op = fsop.encode_setattr(
            inode,
            valid,
            attr.st_mode & fsop.MODE_BITS if fields.update_mode else 0,
            attr.st_uid if fields.update_uid else 0,
            attr.st_gid if fields.update_gid else 0,
            attr.st_size if fields.update_size else 0,
            attr.st_atime_ns if fields.update_atime else 0,
            attr.st_mtime_ns if fields.update_mtime else 0,
        )
        return self._entry((await self.svc.call(op)).attr)

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return (await self.svc.call(fsop.encode_readlink(inode))).data

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if mode & fsop.S_IFMT != fsop.S_IFREG:
            raise pyfuse3.FUSEError(errno.EPERM)
        op = fsop.encode_create(parent_inode, name, mode & fsop.MODE_BITS, ctx.uid, ctx.gid)
        return self._entry((await self.svc.call(op)).attr)

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        op = fsop.encode_mkdir(parent_inode, name, mode & fsop.MODE_BITS, ctx.uid, ctx.gid)
        return self._entry((await self.svc.call(op)).attr)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.svc.call(fsop.encode_unlink(parent_inode, name))

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.svc.call(fsop.encode_rmdir(parent_inode, name))

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        op = fsop.encode_symlink(parent_inode, name, target, ctx.uid, ctx.gid)
        return self._entry((await self.svc.call(op)).attr)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        wire_flags = 0
        if flags & pyfuse3.RENAME_NOREPLACE:
            wire_flags |= fsop.RENAME_NOREPLACE
        if flags & pyfuse3.RENAME_EXCHANGE:
            wire_flags |= fsop.RENAME_EXCHANGE
        if flags & ~(pyfuse3.RENAME_NOREPLACE | pyfuse3.RENAME_EXCHANGE):
            raise pyfuse3.FUSEError(errno.EINVAL)
        op = fsop.encode_rename(parent_inode_old, name_old, parent_inode_new, name_new, wire_flags)
        await self.svc.call(op)

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        op = fsop.encode_link(inode, new_parent_inode, new_name)
        return self._entry((await self.svc.call(op)).attr)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        # Nothing to ask: the kernel looked the inode up, checked the permissions and sends
        # O_TRUNC as a SETATTR. The page cache is dropped at every open (keep_cache off), so
        # a file another client changed is read afresh.
        return pyfuse3.FileInfo(fh=inode, keep_cache=False)

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        op = fsop.encode_create(parent_inode, name, mode & fsop.MODE_BITS, ctx.uid, ctx.gid)
        entry = self._entry((await self.svc.call(op)).attr)
        return pyfuse3.FileInfo(fh=entry.st_ino, keep_cache=False), entry

    async def read(self, fh: int, off: int, size: int) -> bytes:
        parts = []
        while size > 0:
            n = min(size, CHUNK)
            data = (await self.svc.call(fsop.encode_read(fh, off, n))).data
            parts.append(data)
            if len(data) < n:
                break
            off += n
            size -= n
        return b"".join(parts)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        view = memoryview(buf)
        for start in range(0, len(buf), CHUNK):
            chunk = bytes(view[start : start + CHUNK])
            await self.svc.call(fsop.encode_write(fh, off + start, chunk))
        return len(buf)

    async def flush(self, fh: int) -> None:
        pass  # every write is already executed by the service when write() returns

    async def release(self, fh: int) -> None:
        pass

    async def fsync(self, fh: int, datasync: bool) -> None:
        pass

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        """The whole listing is read here, page by page (names after the last one), and
        served from this snapshot: entries removed while a program walks the directory
        (rm -r) never shift the others past its offset."""
        entries: list[fsop.DirEntry] = []
        after = b""
        while True:
            r = await self.svc.call(fsop.encode_readdir(inode, after, READDIR_PAGE))
            entries += r.entries
            if not r.more or not r.entries:
                break
            after = r.entries[-1].name
        dh = self._next_dh
        self._next_dh += 1
        self._dirs[dh] = entries
        return dh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self._dirs.get(fh, [])
        for i in range(start_id, len(entries)):
            e = entries[i]
            if not pyfuse3.readdir_reply(token, e.name, self._entry(e.attr), i + 1):
                break

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        pass

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = (await self.svc.call(fsop.encode_statfs())).statfs
        assert s is not None
        out = pyfuse3.StatvfsData()
        out.f_bsize = out.f_frsize = s.bsize
        out.f_blocks = s.blocks
        out.f_bfree = out.f_bavail = s.bfree
        out.f_files = s.files
        out.f_ffree = out.f_favail = s.ffree
        out.f_namemax = s.namemax
        return out


# ---- mounting ----------------------------------------------------------------------------


async def serve(
    config: Config,
    service: str,
    mountpoint: str,
    options: MountOptions,
    clients: int | None = None,
    first_client: int = 0,
) -> None:
    """Mount the service at `mountpoint` and serve until it is unmounted (zz umount,
    fusermount3 -u) or SIGINT/SIGTERM, which unmount it."""
    svc = config.service(service)
    if svc.app != "files":
        raise MountError(f"service {svc.name!r} runs app {svc.app!r}, not 'files'")
    if mounted_zz(mountpoint):
        raise MountError(
            f"{mountpoint} is already a zz mount (one whose process died answers 'Transport"
            " endpoint is not connected': zz umount it first)"
        )
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not a directory")
    count = clients if clients is not None else min(4, svc.clients - first_client)
    try:
        pool = ClientPool.from_config(config, svc, count, first_client)
    except ValueError as e:
        raise MountError(str(e)) from None
    pool.start()
    fs_service = FsService(pool, options.timeout)
    try:
        # Refuse to mount a service that does not answer: better an error now than a
        # mount whose every access times out.
        try:
            root = await fs_service.call(fsop.encode_getattr(fsop.ROOT_INO))
        except pyfuse3.FUSEError as e:
            raise MountError(
                f"service {svc.name!r}: no certified answer to GETATTR of the root"
                f" ({os.strerror(e.errno)}, timeout {options.timeout:g} s)"
            ) from None
        assert root.attr is not None
        ops = ZzFs(fs_service, options)
        opts = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
        opts |= {f"fsname=zz:{svc.name}", "subtype=zz"}
        if options.allow_other:
            opts.add("allow_other")
        pyfuse3.asyncio.enable()
        pyfuse3.init(ops, mountpoint, opts)
        stopped = False

        def stop() -> None:
            nonlocal stopped
            stopped = True
            pyfuse3.terminate()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        log.info("mounted %s (service %s, %d clients) at %s", config.path, svc.name, count,
                 mountpoint)  # fmt: skip
        try:
            await pyfuse3.main(max_tasks=options.max_tasks)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            # After an unmount from outside the kernel session is gone: only clean up.
            pyfuse3.close(unmount=stopped or mounted_zz(mountpoint))
        log.info("unmounted %s; %s, clients rekeyed %d", mountpoint, fs_service.stats,
                 pool.stats["rekeyed"])  # fmt: skip
    finally:
        await pool.close()
