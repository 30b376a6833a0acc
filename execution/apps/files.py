"""execution/apps/files.py - a replicated POSIX-style file service (docs/files.md).
Every inode is a state file and every regular file's bytes another, so a checkpoint re-hashes,
and a recovering replica fetches, only the inodes and files a request touched."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from zz.execution.app import App, ExecContext
from zz.execution.state import ReadOnlyStateError
from zz.fsop import (
    CREATE,
    EEXIST,
    EFBIG,
    EINVAL,
    EISDIR,
    EMLINK,
    ENAMETOOLONG,
    ENOENT,
    ENOSPC,
    ENOTDIR,
    ENOTEMPTY,
    EPERM,
    EPROTO,
    EROFS,
    ESTALE,
    GETATTR,
    LINK,
    LOOKUP,
    MKDIR,
    MODE_BITS,
    NAME_MAX,
    OK,
    PATH_MAX,
    READ,
    READDIR,
    READLINK,
    RENAME,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    RMDIR,
    ROOT_INO,
    S_IFDIR,
    S_IFLNK,
    S_IFMT,
    S_IFREG,
    SET_ATIME,
    SET_GID,
    SET_MODE,
    SET_MTIME,
    SET_SIZE,
    SET_UID,
    SETATTR,
    STATFS,
    SYMLINK,
    UNLINK,
    WRITE,
    Attr,
    DirEntry,
    FsDecodeError,
    FsOp,
    FsReply,
    StatFs,
    decode_op,
    encode_reply,
    error,
)

DATA_DIR = "fs"
SUPER_PATH = "fs/super"
BLOCK = 4096
MAX_READDIR = 4096  # most entries one READDIR returns
_U32_MAX = 0xFFFFFFFF
S_ISGID = 0o2000

# fs/super: u8 version 1, u64 next_ino, u64 inodes, u64 bytes.
_SUPER = struct.Struct(">BQQQ")
# Inode file head: u8 version 1, mode, nlink, uid, gid, size, atime_ns, mtime_ns, ctime_ns.
_INODE = struct.Struct(">BIIIIQQQQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


def inode_path(ino: int) -> str:
    """State file of inode `ino`; 256 buckets keep directories small."""
    return f"{DATA_DIR}/i/{ino & 0xFF:02x}/{ino}"


def data_path(ino: int) -> str:
    """State file holding a regular file's bytes (absent while the file is empty)."""
    return f"{DATA_DIR}/d/{ino & 0xFF:02x}/{ino}"


class FsError(Exception):
    """Ends a request with an error reply; nothing the request changed is written."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Inode:
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    parent: int = 0  # directories: the directory holding this one (the root: itself)
    entries: dict[bytes, int] = field(default_factory=dict)  # directories: name -> ino
    target: bytes = b""  # symlinks

    @property
    def kind(self) -> int:
        return self.mode & S_IFMT

    def attr(self) -> Attr:
        return Attr(
            self.ino,
            self.mode,
            self.nlink,
            self.uid,
            self.gid,
            self.size,
            self.atime_ns,
            self.mtime_ns,
            self.ctime_ns,
        )

    def encode(self) -> bytes:
        head = _INODE.pack(
            1,
            self.mode,
            self.nlink,
            self.uid,
            self.gid,
            self.size,
            self.atime_ns,
            self.mtime_ns,
            self.ctime_ns,
        )
        if self.kind == S_IFDIR:
            parts = [head, _U64.pack(self.parent), _U32.pack(len(self.entries))]
            for name in sorted(self.entries):
                parts += [_U16.pack(len(name)), name, _U64.pack(self.entries[name])]
            return b"".join(parts)
        if self.kind == S_IFLNK:
            return head + self.target
        return head

    @classmethod
    def decode(cls, ino: int, raw: bytes) -> Inode:
        # Only a corrupted state file fails here: the runtime then stops this replica and
        # recovery fetches the certified file (as the kv app does).
        try:
            version, *attrs = _INODE.unpack_from(raw, 0)
            if version != 1:
                raise ValueError(f"version {version}")
            node = cls(ino, *attrs)
            pos = _INODE.size
            if node.kind == S_IFDIR:
                (node.parent,) = _U64.unpack_from(raw, pos)
                (count,) = _U32.unpack_from(raw, pos + 8)
                pos += 12
                for _ in range(count):
                    (n,) = _U16.unpack_from(raw, pos)
                    name = raw[pos + 2 : pos + 2 + n]
                    (child,) = _U64.unpack_from(raw, pos + 2 + n)
                    node.entries[name] = child
                    pos += 10 + n
                if pos != len(raw):
                    raise ValueError("trailing bytes")
            elif node.kind == S_IFLNK:
                node.target = raw[pos:]
            elif pos != len(raw):
                raise ValueError("trailing bytes")
            return node
        except (struct.error, ValueError) as e:
            raise RuntimeError(f"files: state file {inode_path(ino)} is corrupt: {e}") from e


@dataclass
class Super:
    next_ino: int
    inodes: int
    bytes: int

    def encode(self) -> bytes:
        return _SUPER.pack(1, self.next_ino, self.inodes, self.bytes)


def check_name(name: bytes) -> None:
    """A name a directory entry may have: 1..NAME_MAX bytes, no '/' or NUL."""
    if not name:
        raise FsError(ENOENT, "empty name")
    if len(name) > NAME_MAX:
        raise FsError(ENAMETOOLONG, f"name of {len(name)} bytes, over {NAME_MAX}")
    if b"/" in name or b"\0" in name:
        raise FsError(EINVAL, "a name must not contain '/' or NUL")


class _Txn:
    """The inodes one request reads and changes: loaded once (so two names for one inode
    are one object), written back only if the request succeeds."""

    def __init__(self, app: FilesApp, now_ns: int) -> None:
        self.app = app
        self.now = now_ns
        self.nodes: dict[int, Inode | None] = {}
        self.dirty: set[int] = set()
        self.gone: set[int] = set()
        self.data: dict[int, int] = {}  # ino -> new size of its data file (truncate/extend)
        self.writes: list[tuple[int, int, bytes]] = []
        self._super: Super | None = None
        self.super_dirty = False

    # -- reading ---------------------------------------------------------------------
    def get(self, ino: int) -> Inode:
        if ino not in self.nodes:
            self.nodes[ino] = self.app.load(ino)
        node = self.nodes[ino]
        if node is None:
            raise FsError(ESTALE, f"no inode {ino}")
        return node

    def dir(self, ino: int) -> Inode:
        node = self.get(ino)
        if node.kind != S_IFDIR:
            raise FsError(ENOTDIR, f"inode {ino} is not a directory")
        return node

    @property
    def super(self) -> Super:
        if self._super is None:
            self._super = self.app.load_super()
        return self._super

    # -- changing ----------------------------------------------------------------------
    def touch(self, node: Inode, mtime: bool = True) -> None:
        node.ctime_ns = self.now
        if mtime:
            node.mtime_ns = self.now
        self.dirty.add(node.ino)

    def new(self, parent: Inode, mode: int, uid: int, gid: int) -> Inode:
        s = self.super
        if s.inodes >= self.app.max_inodes:
            raise FsError(ENOSPC, f"all {self.app.max_inodes} inodes in use")
        if parent.mode & S_ISGID:  # BSD group semantics of a setgid directory
            gid = parent.gid
            if mode & S_IFMT == S_IFDIR:
                mode |= S_ISGID
        ino = s.next_ino
        s.next_ino += 1
        s.inodes += 1
        self.super_dirty = True
        nlink = 2 if mode & S_IFMT == S_IFDIR else 1
        node = Inode(ino, mode, nlink, uid, gid, 0, self.now, self.now, self.now)
        self.nodes[ino] = node
        self.dirty.add(ino)
        return node

    def resize(self, node: Inode, size: int) -> None:
        if size > self.app.max_file_size:
            raise FsError(EFBIG, f"size {size} over the file limit of {self.app.max_file_size}")
        grow = size - node.size
        if grow > 0 and self.super.bytes + grow > self.app.max_bytes:
            raise FsError(ENOSPC, f"the service's {self.app.max_bytes} bytes are used up")
        if grow:
            self.super.bytes += grow
            self.super_dirty = True
        node.size = size

    def drop_link(self, node: Inode) -> None:
        """One name of `node` is gone: free it with its last link."""
        node.nlink -= 1
        if node.kind == S_IFDIR or node.nlink == 0:
            self.gone.add(node.ino)
            self.dirty.discard(node.ino)
            s = self.super
            s.inodes -= 1
            s.bytes -= node.size if node.kind != S_IFDIR else 0
            self.super_dirty = True
        else:
            self.touch(node, mtime=False)

    # -- writing back -------------------------------------------------------------------
    def commit(self) -> None:
        st = self.app.state
        for ino, off, data in self.writes:
            node = self.nodes[ino]
            assert node is not None
            if ino in self.gone:
                continue
            st.write_at(data_path(ino), off, data)
        for ino, size in sorted(self.data.items()):
            if ino in self.gone:
                continue
            path = data_path(ino)
            if size == 0:
                if st.exists(path):
                    st.delete(path)
            else:
                with st.open(path, "r+b" if st.exists(path) else "wb") as f:
                    f.truncate(size)
        for ino in sorted(self.gone):
            for path in (inode_path(ino), data_path(ino)):
                if st.exists(path):
                    st.delete(path)
        for ino in sorted(self.dirty):
            node = self.nodes[ino]
            assert node is not None
            st.write_bytes(inode_path(ino), node.encode())
        if self.super_dirty:
            st.write_bytes(SUPER_PATH, self.super.encode())


class FilesApp(App):
    """A hierarchical namespace of directories, regular files and symlinks, addressed by
    inode number (the root is 1) like the FUSE low-level protocol. The service checks no
    permissions: every client of the service may do anything (a FUSE mount checks them in
    the kernel against the attributes, `default_permissions`)."""

    name = "files"

    def __init__(
        self,
        max_bytes: int = 1 << 33,
        max_inodes: int = 1_000_000,
        max_file_size: int = 1 << 30,
        max_io: int = 1 << 20,
        root_mode: int = 0o755,
        root_uid: int = 0,
        root_gid: int = 0,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_inodes = max_inodes
        self.max_file_size = max_file_size
        self.max_io = max_io
        self.root_mode = root_mode
        self.root_uid = root_uid
        self.root_gid = root_gid

    # -- state ---------------------------------------------------------------------------
    def load(self, ino: int) -> Inode | None:
        if ino <= 0:
            return None
        try:
            raw = self.state.read_bytes(inode_path(ino))
        except FileNotFoundError:
            if ino == ROOT_INO:
                # Until the first change the root exists only here; every replica starts
                # from the same empty directory, written with the first change to it.
                mode = S_IFDIR | self.root_mode
                return Inode(ROOT_INO, mode, 2, self.root_uid, self.root_gid, 0, 0, 0, 0, ROOT_INO)
            return None
        return Inode.decode(ino, raw)

    def load_super(self) -> Super:
        try:
            raw = self.state.read_bytes(SUPER_PATH)
        except FileNotFoundError:
            return Super(ROOT_INO + 1, 1, 0)
        try:
            version, next_ino, inodes, used = _SUPER.unpack(raw)
        except struct.error as e:
            raise RuntimeError(f"files: state file {SUPER_PATH} is corrupt: {e}") from e
        if version != 1:
            raise RuntimeError(f"files: state file {SUPER_PATH} has version {version}")
        return Super(next_ino, inodes, used)

    # -- requests --------------------------------------------------------------------------
    def is_read_only(self, op: bytes) -> bool:
        try:
            return decode_op(op).read_only
        except FsDecodeError:
            return False

    def execute(self, op: bytes, ctx: ExecContext) -> bytes:
        try:
            req = decode_op(op)
        except FsDecodeError as e:
            code = op[0] if op else 0
            return encode_reply(code, error(EPROTO, str(e)))
        if ctx.read_only and not req.read_only:
            return encode_reply(req.code, error(EROFS, "a write op in a read-only request"))
        txn = _Txn(self, ctx.time_ms * 1_000_000)
        try:
            reply = self._apply(req, txn)
            txn.commit()
        except FsError as e:
            reply = error(e.status, str(e))
        except ReadOnlyStateError:
            reply = error(EROFS, "a write op in a read-only request")
        return encode_reply(req.code, reply)

    def _apply(self, op: FsOp, t: _Txn) -> FsReply:
        handler = _HANDLERS[op.code]
        return handler(self, op, t)

    def _lookup(self, op: FsOp, t: _Txn) -> FsReply:
        d = t.dir(op.ino)
        if op.name == b".":
            return FsReply(OK, attr=d.attr())
        if op.name == b"..":
            return FsReply(OK, attr=t.get(d.parent).attr())
        check_name(op.name)
        child = d.entries.get(op.name)
        if child is None:
            raise FsError(ENOENT, "no such entry")
        return FsReply(OK, attr=t.get(child).attr())

    def _getattr(self, op: FsOp, t: _Txn) -> FsReply:
        return FsReply(OK, attr=t.get(op.ino).attr())

    def _setattr(self, op: FsOp, t: _Txn) -> FsReply:
        node = t.get(op.ino)
        v = op.flags
        if v & SET_MODE:
            if op.mode & S_IFMT and op.mode & S_IFMT != node.kind:
                raise FsError(EINVAL, "SETATTR cannot change the file type")
            node.mode = node.kind | (op.mode & MODE_BITS)
        if v & SET_UID:
            node.uid = op.uid
        if v & SET_GID:
            node.gid = op.gid
        if v & SET_SIZE:
            if node.kind == S_IFDIR:
                raise FsError(EISDIR, "a directory has no size to set")
            if node.kind != S_IFREG:
                raise FsError(EINVAL, "only a regular file's size can be set")
            if op.size != node.size:
                t.resize(node, op.size)
                t.data[node.ino] = op.size
            node.mtime_ns = t.now
        if v & SET_ATIME:
            node.atime_ns = op.atime_ns
        if v & SET_MTIME:
            node.mtime_ns = op.mtime_ns
        t.touch(node, mtime=False)
        return FsReply(OK, attr=node.attr())

    def _add(self, t: _Txn, parent: Inode, name: bytes) -> None:
        """Checks that `name` can be made in `parent`."""
        check_name(name)
        if name in (b".", b"..") or name in parent.entries:
            raise FsError(EEXIST, "the name exists")

    def _create(self, op: FsOp, t: _Txn) -> FsReply:
        parent = t.dir(op.ino)
        self._add(t, parent, op.name)
        if op.mode & S_IFMT not in (0, S_IFREG):
            raise FsError(EPERM, "only regular files, directories and symlinks are supported")
        node = t.new(parent, S_IFREG | (op.mode & MODE_BITS), op.uid, op.gid)
        parent.entries[op.name] = node.ino
        t.touch(parent)
        return FsReply(OK, attr=node.attr())

    def _mkdir(self, op: FsOp, t: _Txn) -> FsReply:
        parent = t.dir(op.ino)
        self._add(t, parent, op.name)
        if parent.nlink >= _U32_MAX:
            raise FsError(EMLINK, "too many subdirectories")
        node = t.new(parent, S_IFDIR | (op.mode & MODE_BITS), op.uid, op.gid)
        node.parent = parent.ino
        parent.entries[op.name] = node.ino
        parent.nlink += 1
        t.touch(parent)
        return FsReply(OK, attr=node.attr())

    def _symlink(self, op: FsOp, t: _Txn) -> FsReply:
        parent = t.dir(op.ino)
        self._add(t, parent, op.name)
        if not op.data or b"\0" in op.data:
            raise FsError(EINVAL, "a symlink target is 1.. bytes without NUL")
        if len(op.data) > PATH_MAX:
            raise FsError(ENAMETOOLONG, f"symlink target over {PATH_MAX} bytes")
        node = t.new(parent, S_IFLNK | 0o777, op.uid, op.gid)
        node.target = op.data
        t.resize(node, len(op.data))
        parent.entries[op.name] = node.ino
        t.touch(parent)
        return FsReply(OK, attr=node.attr())

    def _readlink(self, op: FsOp, t: _Txn) -> FsReply:
        node = t.get(op.ino)
        if node.kind != S_IFLNK:
            raise FsError(EINVAL, "not a symlink")
        return FsReply(OK, data=node.target)

    def _regular(self, t: _Txn, ino: int) -> Inode:
        node = t.get(ino)
        if node.kind == S_IFDIR:
            raise FsError(EISDIR, "is a directory")
        if node.kind != S_IFREG:
            raise FsError(EINVAL, "not a regular file")
        return node

    def _read(self, op: FsOp, t: _Txn) -> FsReply:
        node = self._regular(t, op.ino)
        if op.size > self.max_io:
            raise FsError(EINVAL, f"read of {op.size} bytes, over the limit of {self.max_io}")
        if op.offset >= node.size or op.size == 0:
            return FsReply(OK, data=b"")
        n = min(op.size, node.size - op.offset)
        with self.state.open(data_path(node.ino), "rb") as f:
            f.seek(op.offset)
            data = f.read(n)
        return FsReply(OK, data=data.ljust(n, b"\0"))

    def _write(self, op: FsOp, t: _Txn) -> FsReply:
        node = self._regular(t, op.ino)
        if len(op.data) > self.max_io:
            raise FsError(EINVAL, f"write of {len(op.data)} bytes, over the limit of {self.max_io}")
        if op.data:
            end = op.offset + len(op.data)
            if end > node.size:
                t.resize(node, end)
            t.writes.append((node.ino, op.offset, op.data))
            t.touch(node)
        return FsReply(OK, attr=node.attr())

    def _entry(self, t: _Txn, parent: Inode, name: bytes) -> Inode:
        check_name(name)
        child = parent.entries.get(name)
        if child is None:
            raise FsError(ENOENT, "no such entry")
        return t.get(child)

    def _unlink(self, op: FsOp, t: _Txn) -> FsReply:
        parent = t.dir(op.ino)
        if op.name in (b".", b".."):
            raise FsError(EISDIR, "is a directory")
        node = self._entry(t, parent, op.name)
        if node.kind == S_IFDIR:
            raise FsError(EISDIR, "is a directory")
        del parent.entries[op.name]
        t.drop_link(node)
        t.touch(parent)
        return FsReply(OK)

    def _rmdir(self, op: FsOp, t: _Txn) -> FsReply:
        parent = t.dir(op.ino)
        if op.name == b".":
            raise FsError(EINVAL, "cannot remove '.'")
        if op.name == b"..":
            raise FsError(ENOTEMPTY, "cannot remove '..'")
        node = self._entry(t, parent, op.name)
        if node.kind != S_IFDIR:
            raise FsError(ENOTDIR, "not a directory")
        if node.entries:
            raise FsError(ENOTEMPTY, "directory not empty")
        del parent.entries[op.name]
        parent.nlink -= 1
        t.drop_link(node)
        t.touch(parent)
        return FsReply(OK)

    def _inside(self, t: _Txn, d: Inode, ancestor: int) -> bool:
        """Whether directory `d` is `ancestor` or below it."""
        seen = 0
        while True:
            if d.ino == ancestor:
                return True
            if d.ino == ROOT_INO or d.parent == d.ino:
                return False
            seen += 1
            if seen > self.max_inodes:
                raise RuntimeError("files: a directory cycle in the state")
            d = t.get(d.parent)

    def _move(self, t: _Txn, node: Inode, old: Inode, new: Inode) -> None:
        """Directory `node` moves from `old` to `new`: parent pointer and link counts."""
        if node.kind == S_IFDIR and old.ino != new.ino:
            old.nlink -= 1
            new.nlink += 1
            node.parent = new.ino
            t.dirty.add(node.ino)

    def _rename(self, op: FsOp, t: _Txn) -> FsReply:
        if op.flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or op.flags == (
            RENAME_NOREPLACE | RENAME_EXCHANGE
        ):
            raise FsError(EINVAL, f"bad rename flags {op.flags:#x}")
        old, new = t.dir(op.ino), t.dir(op.new_ino)
        for name in (op.name, op.new_name):
            if name in (b".", b".."):
                raise FsError(EINVAL, "cannot rename '.' or '..'")
        src = self._entry(t, old, op.name)
        check_name(op.new_name)
        dst_ino = new.entries.get(op.new_name)
        dst = t.get(dst_ino) if dst_ino is not None else None
        if op.flags & RENAME_EXCHANGE:
            if dst is None:
                raise FsError(ENOENT, "RENAME_EXCHANGE: the new name does not exist")
            if src.kind == S_IFDIR and self._inside(t, new, src.ino):
                raise FsError(EINVAL, "cannot move a directory below itself")
            if dst.kind == S_IFDIR and self._inside(t, old, dst.ino):
                raise FsError(EINVAL, "cannot move a directory below itself")
            old.entries[op.name], new.entries[op.new_name] = dst.ino, src.ino
            self._move(t, src, old, new)
            self._move(t, dst, new, old)
            t.touch(src, mtime=False)
            t.touch(dst, mtime=False)
            t.touch(old)
            t.touch(new)
            return FsReply(OK)
        if dst is not None and op.flags & RENAME_NOREPLACE:
            raise FsError(EEXIST, "the new name exists")
        if src.kind == S_IFDIR and self._inside(t, new, src.ino):
            raise FsError(EINVAL, "cannot move a directory below itself")
        if dst is not None:
            if dst.ino == src.ino:
                return FsReply(OK)  # two names of one inode: POSIX says do nothing
            if src.kind == S_IFDIR:
                if dst.kind != S_IFDIR:
                    raise FsError(ENOTDIR, "cannot replace a non-directory by a directory")
                if dst.entries:
                    raise FsError(ENOTEMPTY, "the directory to replace is not empty")
                new.nlink -= 1
            elif dst.kind == S_IFDIR:
                raise FsError(EISDIR, "cannot replace a directory by a non-directory")
            t.drop_link(dst)
        del old.entries[op.name]
        new.entries[op.new_name] = src.ino
        self._move(t, src, old, new)
        t.touch(src, mtime=False)
        t.touch(old)
        t.touch(new)
        return FsReply(OK)

    def _link(self, op: FsOp, t: _Txn) -> FsReply:
        node = t.get(op.ino)
        if node.kind == S_IFDIR:
            raise FsError(EPERM, "cannot hard-link a directory")
        parent = t.dir(op.new_ino)
        self._add(t, parent, op.new_name)
        if node.nlink >= _U32_MAX:
            raise FsError(EMLINK, "too many links")
        node.nlink += 1
        parent.entries[op.new_name] = node.ino
        t.touch(node, mtime=False)
        t.touch(parent)
        return FsReply(OK, attr=node.attr())

    def _readdir(self, op: FsOp, t: _Txn) -> FsReply:
        d = t.dir(op.ino)
        if not 1 <= op.size <= MAX_READDIR:
            raise FsError(EINVAL, f"READDIR max entries must be 1..{MAX_READDIR}")
        names = sorted(n for n in d.entries if n > op.data)
        out = tuple(DirEntry(n, t.get(d.entries[n]).attr()) for n in names[: op.size])
        return FsReply(OK, entries=out, more=len(names) > op.size)

    def _statfs(self, op: FsOp, t: _Txn) -> FsReply:
        s = t.super
        free = max(self.max_bytes - s.bytes, 0)
        return FsReply(
            OK,
            statfs=StatFs(
                BLOCK,
                self.max_bytes // BLOCK,
                free // BLOCK,
                self.max_inodes,
                max(self.max_inodes - s.inodes, 0),
                NAME_MAX,
            ),
        )


_HANDLERS = {
    LOOKUP: FilesApp._lookup,
    GETATTR: FilesApp._getattr,
    SETATTR: FilesApp._setattr,
    CREATE: FilesApp._create,
    MKDIR: FilesApp._mkdir,
    SYMLINK: FilesApp._symlink,
    READLINK: FilesApp._readlink,
    READ: FilesApp._read,
    WRITE: FilesApp._write,
    UNLINK: FilesApp._unlink,
    RMDIR: FilesApp._rmdir,
    RENAME: FilesApp._rename,
    LINK: FilesApp._link,
    READDIR: FilesApp._readdir,
    STATFS: FilesApp._statfs,
}
