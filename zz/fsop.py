"""zz/fsop.py - the file service's op and reply encoding (docs/files.md).
`zz mount` (zz/mount.py) encodes ops and decodes replies; the app (execution/apps/files.py)
decodes ops and encodes replies. All integers big-endian; a field is u32 length + bytes."""

from __future__ import annotations

import struct
from dataclasses import dataclass

# Op codes (docs/files.md "Ops").
LOOKUP = 1
GETATTR = 2
SETATTR = 3
CREATE = 4
MKDIR = 5
SYMLINK = 6
READLINK = 7
READ = 8
WRITE = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
READDIR = 14
STATFS = 15
OP_NAMES = {
    LOOKUP: "LOOKUP",
    GETATTR: "GETATTR",
    SETATTR: "SETATTR",
    CREATE: "CREATE",
    MKDIR: "MKDIR",
    SYMLINK: "SYMLINK",
    READLINK: "READLINK",
    READ: "READ",
    WRITE: "WRITE",
    UNLINK: "UNLINK",
    RMDIR: "RMDIR",
    RENAME: "RENAME",
    LINK: "LINK",
    READDIR: "READDIR",
    STATFS: "STATFS",
}
# The ops that never change state: sent as reads (ordered, without write access).
READ_OPS = frozenset({LOOKUP, GETATTR, READLINK, READ, READDIR, STATFS})

# Reply status: 0 or an error number. The numbers are Linux's (fixed here, not taken from
# the platform's errno module, so that every replica and client agrees on them).
OK = 0
EPERM = 1
ENOENT = 2
EIO = 5
EEXIST = 17
EXDEV = 18
ENOTDIR = 20
EISDIR = 21
EINVAL = 22
EFBIG = 27
ENOSPC = 28
EROFS = 30
EMLINK = 31
ENAMETOOLONG = 36
ENOTEMPTY = 39
EPROTO = 71  # a malformed op
ESTALE = 116  # an inode number that names no inode (any more)
ERROR_NAMES = {
    EPERM: "EPERM",
    ENOENT: "ENOENT",
    EIO: "EIO",
    EEXIST: "EEXIST",
    EXDEV: "EXDEV",
    ENOTDIR: "ENOTDIR",
    EISDIR: "EISDIR",
    EINVAL: "EINVAL",
    EFBIG: "EFBIG",
    ENOSPC: "ENOSPC",
    EROFS: "EROFS",
    EMLINK: "EMLINK",
    ENAMETOOLONG: "ENAMETOOLONG",
    ENOTEMPTY: "ENOTEMPTY",
    EPROTO: "EPROTO",
    ESTALE: "ESTALE",
}

ROOT_INO = 1
NAME_MAX = 255
PATH_MAX = 4096  # longest symlink target

# File types in the mode (st_mode's S_IFMT bits, as on Linux).
S_IFMT = 0o170000
S_IFDIR = 0o040000
S_IFREG = 0o100000
S_IFLNK = 0o120000
MODE_BITS = 0o7777  # permission, setuid, setgid and sticky bits

# SETATTR's `valid` bits.
SET_MODE = 1
SET_UID = 2
SET_GID = 4
SET_SIZE = 8
SET_ATIME = 16
SET_MTIME = 32
SET_ALL = 63

# RENAME flags (renameat2's values on Linux).
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
# ino, mode, nlink, uid, gid, size, atime_ns, mtime_ns, ctime_ns
_ATTR = struct.Struct(">QIIIIQQQQ")
# bsize, blocks, bfree, files, ffree, namemax
_STATFS = struct.Struct(">IQQQQI")


class FsDecodeError(ValueError):
    """Bytes that are not a valid file-service op or reply."""


def field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + bytes(data)


@dataclass(frozen=True)
class Attr:
    """An inode's attributes as the replies carry them (times in ns since the epoch)."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int

    def encode(self) -> bytes:
        return _ATTR.pack(
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

    @property
    def is_dir(self) -> bool:
        return self.mode & S_IFMT == S_IFDIR

    @property
    def is_reg(self) -> bool:
        return self.mode & S_IFMT == S_IFREG

    @property
    def is_symlink(self) -> bool:
        return self.mode & S_IFMT == S_IFLNK


@dataclass(frozen=True)
class StatFs:
    bsize: int
    blocks: int
    bfree: int
    files: int
    ffree: int
    namemax: int

    def encode(self) -> bytes:
        return _STATFS.pack(
            self.bsize, self.blocks, self.bfree, self.files, self.ffree, self.namemax
        )


@dataclass(frozen=True)
class FsOp:
    """A decoded op; which fields are meaningful depends on `code` (docs/files.md)."""

    code: int
    ino: int = 0  # the inode, or the parent directory of `name`
    name: bytes = b""
    mode: int = 0
    uid: int = 0
    gid: int = 0
    offset: int = 0
    size: int = 0  # READ: bytes wanted; SETATTR: new size; READDIR: most entries
    data: bytes = b""  # WRITE: the bytes; SYMLINK: the target; READDIR: list after this name
    new_ino: int = 0  # RENAME, LINK: the new parent
    new_name: bytes = b""
    flags: int = 0  # SETATTR: valid bits; RENAME: flags
    atime_ns: int = 0
    mtime_ns: int = 0

    @property
    def read_only(self) -> bool:
        return self.code in READ_OPS


# -- client-side encoding ----------------------------------------------------------


def _op(code: int, *parts: bytes) -> bytes:
    return bytes([code]) + b"".join(parts)


def encode_lookup(parent: int, name: bytes) -> bytes:
    return _op(LOOKUP, _U64.pack(parent), field(name))


def encode_getattr(ino: int) -> bytes:
    return _op(GETATTR, _U64.pack(ino))


def encode_setattr(
    ino: int,
    valid: int,
    mode: int = 0,
    uid: int = 0,
    gid: int = 0,
    size: int = 0,
    atime_ns: int = 0,
    mtime_ns: int = 0,
) -> bytes:
    """Change the attributes whose SET_* bit is in `valid` (the others' values are ignored
    but must still be encoded; 0 is canonical)."""
    return _op(
        SETATTR,
        _U64.pack(ino),
        _U32.pack(valid),
        _U32.pack(mode),
        _U32.pack(uid),
        _U32.pack(gid),
        _U64.pack(size),
        _U64.pack(atime_ns),
        _U64.pack(mtime_ns),
    )


def _creator(code: int, parent: int, name: bytes, mode: int, uid: int, gid: int) -> bytes:
    return _op(
        code, _U64.pack(parent), field(name), _U32.pack(mode), _U32.pack(uid), _U32.pack(gid)
    )


def encode_create(parent: int, name: bytes, mode: int, uid: int, gid: int) -> bytes:
    """A regular file; `mode` holds the permission bits (a type, if given, must be S_IFREG)."""
    return _creator(CREATE, parent, name, mode, uid, gid)


def encode_mkdir(parent: int, name: bytes, mode: int, uid: int, gid: int) -> bytes:
    return _creator(MKDIR, parent, name, mode, uid, gid)


def encode_symlink(parent: int, name: bytes, target: bytes, uid: int, gid: int) -> bytes:
    return _op(
        SYMLINK, _U64.pack(parent), field(name), field(target), _U32.pack(uid), _U32.pack(gid)
    )


def encode_readlink(ino: int) -> bytes:
    return _op(READLINK, _U64.pack(ino))


def encode_read(ino: int, offset: int, size: int) -> bytes:
    return _op(READ, _U64.pack(ino), _U64.pack(offset), _U32.pack(size))


def encode_write(ino: int, offset: int, data: bytes) -> bytes:
    return _op(WRITE, _U64.pack(ino), _U64.pack(offset), field(data))


def encode_unlink(parent: int, name: bytes) -> bytes:
    return _op(UNLINK, _U64.pack(parent), field(name))


def encode_rmdir(parent: int, name: bytes) -> bytes:
    return _op(RMDIR, _U64.pack(parent), field(name))


def encode_rename(
    parent: int, name: bytes, new_parent: int, new_name: bytes, flags: int = 0
) -> bytes:
    return _op(
        RENAME,
        _U64.pack(parent),
        field(name),
        _U64.pack(new_parent),
        field(new_name),
        _U32.pack(flags),
    )


def encode_link(ino: int, new_parent: int, new_name: bytes) -> bytes:
    return _op(LINK, _U64.pack(ino), _U64.pack(new_parent), field(new_name))


def encode_readdir(ino: int, after: bytes = b"", max_entries: int = 1024) -> bytes:
    """Entries of directory `ino` whose names sort (as bytes) after `after`, at most
    `max_entries` of them; b"" starts at the first."""
    return _op(READDIR, _U64.pack(ino), field(after), _U32.pack(max_entries))


def encode_statfs() -> bytes:
    return _op(STATFS)


# -- decoding ------------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(bytes(data))
        self.pos = 0

    def _take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.data):
            raise FsDecodeError(f"truncated at {what}")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def u8(self, what: str) -> int:
        return int(self._take(1, what)[0])

    def u16(self, what: str) -> int:
        return int(_U16.unpack(self._take(2, what))[0])

    def u32(self, what: str) -> int:
        return int(_U32.unpack(self._take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack(self._take(8, what))[0])

    def field(self, what: str) -> bytes:
        n = self.u32(f"{what} length")
        if self.pos + n > len(self.data):
            left = len(self.data) - self.pos
            raise FsDecodeError(f"{what} length {n} exceeds the {left} bytes left")
        return bytes(self._take(n, what))

    def attr(self) -> Attr:
        return Attr(*_ATTR.unpack(self._take(_ATTR.size, "attributes")))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise FsDecodeError(f"{len(self.data) - self.pos} trailing bytes")


def decode_op(data: bytes) -> FsOp:
    """The op, or FsDecodeError (unknown code, truncated, trailing bytes)."""
    r = _Reader(data)
    code = r.u8("op code")
    if code not in OP_NAMES:
        raise FsDecodeError(f"unknown op code {code}")
    if code in (LOOKUP, UNLINK, RMDIR):
        op = FsOp(code, ino=r.u64("parent"), name=r.field("name"))
    elif code in (GETATTR, READLINK):
        op = FsOp(code, ino=r.u64("inode"))
    elif code == SETATTR:
        ino, valid = r.u64("inode"), r.u32("valid")
        if valid & ~SET_ALL:
            raise FsDecodeError(f"unknown SETATTR valid bits {valid & ~SET_ALL:#x}")
        op = FsOp(
            code,
            ino=ino,
            flags=valid,
            mode=r.u32("mode"),
            uid=r.u32("uid"),
            gid=r.u32("gid"),
            size=r.u64("size"),
            atime_ns=r.u64("atime"),
            mtime_ns=r.u64("mtime"),
        )
    elif code in (CREATE, MKDIR):
        op = FsOp(
            code,
            ino=r.u64("parent"),
            name=r.field("name"),
            mode=r.u32("mode"),
            uid=r.u32("uid"),
            gid=r.u32("gid"),
        )
    elif code == SYMLINK:
        op = FsOp(
            code,
            ino=r.u64("parent"),
            name=r.field("name"),
            data=r.field("target"),
            uid=r.u32("uid"),
            gid=r.u32("gid"),
        )
    elif code == READ:
        op = FsOp(code, ino=r.u64("inode"), offset=r.u64("offset"), size=r.u32("size"))
    elif code == WRITE:
        op = FsOp(code, ino=r.u64("inode"), offset=r.u64("offset"), data=r.field("data"))
    elif code == RENAME:
        op = FsOp(
            code,
            ino=r.u64("parent"),
            name=r.field("name"),
            new_ino=r.u64("new parent"),
            new_name=r.field("new name"),
            flags=r.u32("flags"),
        )
    elif code == LINK:
        op = FsOp(code, ino=r.u64("inode"), new_ino=r.u64("new parent"), new_name=r.field("name"))
    elif code == READDIR:
        op = FsOp(code, ino=r.u64("inode"), data=r.field("after"), size=r.u32("max entries"))
    else:  # STATFS
        op = FsOp(code)
    r.end()
    return op


# -- replies ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DirEntry:
    name: bytes
    attr: Attr


@dataclass(frozen=True)
class FsReply:
    """`status` 0 with the op's result, or an error number and a UTF-8 message."""

    status: int
    attr: Attr | None = None  # LOOKUP, GETATTR, SETATTR, CREATE, MKDIR, SYMLINK, LINK, WRITE
    data: bytes = b""  # READ: the bytes; READLINK: the target; an error: the message
    entries: tuple[DirEntry, ...] = ()  # READDIR
    more: bool = False  # READDIR: entries after the last one returned
    statfs: StatFs | None = None  # STATFS

    @property
    def ok(self) -> bool:
        return self.status == OK


def error(status: int, message: str = "") -> FsReply:
    return FsReply(status, data=message.encode("utf-8"))


def encode_reply(code: int, reply: FsReply) -> bytes:
    """The reply to an op of `code` (the reply's layout depends on the op)."""
    head = _U16.pack(reply.status)
    if reply.status != OK:
        return head + field(reply.data)
    if code in (READ, READLINK):
        return head + field(reply.data)
    if code == READDIR:
        parts = [head, _U32.pack(len(reply.entries))]
        for e in reply.entries:
            parts += [field(e.name), e.attr.encode()]
        parts.append(_U8.pack(int(reply.more)))
        return b"".join(parts)
    if code == STATFS:
        assert reply.statfs is not None
        return head + reply.statfs.encode()
    if code in (UNLINK, RMDIR, RENAME):
        return head
    assert reply.attr is not None, f"{OP_NAMES[code]} reply without attributes"
    return head + reply.attr.encode()


def decode_reply(code: int, data: bytes) -> FsReply:
    """The reply to an op of `code`, or FsDecodeError."""
    r = _Reader(data)
    status = r.u16("status")
    if status != OK:
        if status not in ERROR_NAMES:
            raise FsDecodeError(f"unknown status {status}")
        reply = FsReply(status, data=r.field("message"))
    elif code in (READ, READLINK):
        reply = FsReply(OK, data=r.field("data"))
    elif code == READDIR:
        n = r.u32("entry count")
        entries = []
        for _ in range(n):
            name = r.field("name")
            entries.append(DirEntry(name, r.attr()))
        more = r.u8("more")
        if more > 1:
            raise FsDecodeError(f"more must be 0 or 1, got {more}")
        reply = FsReply(OK, entries=tuple(entries), more=bool(more))
    elif code == STATFS:
        reply = FsReply(OK, statfs=StatFs(*_STATFS.unpack(r._take(_STATFS.size, "statfs"))))
    elif code in (UNLINK, RMDIR, RENAME):
        reply = FsReply(OK)
    elif code in OP_NAMES:
        reply = FsReply(OK, attr=r.attr())
    else:
        raise FsDecodeError(f"unknown op code {code}")
    r.end()
    return reply
