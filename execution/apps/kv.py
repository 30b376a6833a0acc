"""execution/apps/kv.py - replicated key-value store (GET/PUT/DELETE/CAS/APPEND), a file per key.
One file per key lets a checkpoint re-hash, and a recovery fetch, only the keys touched."""

from __future__ import annotations

import struct
from hashlib import sha256

from zz.execution.app import App, ExecContext
from zz.execution.state import ReadOnlyStateError
from zz.kvop import (
    APPEND,
    BAD_OP,
    CAS,
    CAS_MISMATCH,
    DELETE,
    GET,
    NOT_FOUND,
    OK,
    PUT,
    READ_ONLY,
    TOO_LARGE,
    KvDecodeError,
    KvOp,
    KvReply,
    decode_op,
)

# The op and reply encoding is zz/kvop.py, shared with the clients. A state file is
# field(key) || value, a field being a u32 length and that many bytes, as in the ops.
_U32 = struct.Struct(">I")
DATA_DIR = "kv"


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + bytes(data)


def key_path(key: bytes) -> str:
    """State file of a key: kv/<2 hex>/<sha256 hex>; 256 buckets keep directories small."""
    h = sha256(key).hexdigest()
    return f"{DATA_DIR}/{h[:2]}/{h}"


class KvApp(App):
    """Each key is a file holding u32 key length, key, value (the key is stored so that
    the files alone describe the store; SHA-256 collisions are not considered)."""

    name = "kv"
    buffers_writes = True  # a key's file is only ever replaced whole (_store)

    def __init__(self, max_key: int = 1024, max_value: int = 1 << 20) -> None:
        self.max_key = max_key
        self.max_value = max_value

    def is_read_only(self, op: bytes) -> bool:
        return bool(op) and op[0] == GET

    def _load(self, key: bytes) -> bytes | None:
        path = key_path(key)
        try:
            raw = self.state.read_bytes(path)  # one open, where exists() then read cost two
        except FileNotFoundError:
            return None
        (n,) = _U32.unpack_from(raw, 0)
        if raw[4 : 4 + n] != key:
            # Only a corrupted state file (or a SHA-256 collision) gets here; replying
            # would spread the damage, so stop this replica and let recovery fetch
            # the verified file.
            raise RuntimeError(f"kv state file {path} holds another key")
        return raw[4 + n :]

    def _store(self, key: bytes, value: bytes) -> None:
        self.state.write_bytes(key_path(key), _field(key) + value)

    def execute(self, op: bytes, ctx: ExecContext) -> bytes:
        try:
            req = decode_op(op)
        except KvDecodeError as e:
            return KvReply(BAD_OP, str(e).encode()).encode()
        if len(req.key) > self.max_key:
            return KvReply(TOO_LARGE, f"key over {self.max_key} bytes".encode()).encode()
        if req.code != GET and ctx.read_only:
            return KvReply(READ_ONLY, b"write op in a read-only request").encode()
        try:
            return self._apply(req).encode()
        except ReadOnlyStateError:
            return KvReply(READ_ONLY, b"write op in a read-only request").encode()

    def _apply(self, req: KvOp) -> KvReply:
        if req.code == PUT:
            # A blind write: the request holds the whole new state of the key, so it is
            # applied without reading the old one (ZZ §4.7.2 "apply writes directly"). A
            # replica still fetching its state never fetches a file a PUT overwrites.
            if len(req.value) > self.max_value:
                return KvReply(TOO_LARGE, f"value over {self.max_value} bytes".encode())
            self._store(req.key, req.value)
            return KvReply(OK)
        cur = self._load(req.key)
        if req.code == GET:
            return KvReply(OK, cur) if cur is not None else KvReply(NOT_FOUND)
        if req.code == DELETE:
            if cur is None:
                return KvReply(NOT_FOUND)
            self.state.delete(key_path(req.key))
            return KvReply(OK)
        if req.code == CAS and cur != req.expected:
            return KvReply(CAS_MISMATCH, cur or b"", present=cur is not None)
        new = (cur or b"") + req.value if req.code == APPEND else req.value
        if len(new) > self.max_value:
            return KvReply(TOO_LARGE, f"value over {self.max_value} bytes".encode())
        self._store(req.key, new)
        return KvReply(OK)
