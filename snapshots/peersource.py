# snapshots/peersource.py - the client side of the snapshot file server (snapshots/fileserve.py):
# checkpoint files of one peer over FILE-FETCH / FILE-DATA (docs/wire.md 25/26). Used by a
# woken execution replica's recovery (execution/recovery.py) and by controld staging a
# sleeping spare's warm files (controld/warm.py), which may not import each other.
"""Checkpoint files from one peer (an execution replica or its host's controld).

A blocking socket: it runs in the executor thread while the app waits on a file, in the
background fetch thread, or in controld's warm-staging thread, never on an event loop.
"""

from __future__ import annotations

import socket
import struct
import threading

from zz import wire
from zz.crypto import NULL_DIGEST, SigningKey
from zz.snapshots.fetch import CopyBytes, LaterBytes, Source, SourceError
from zz.snapshots.fileserve import CHALLENGE, COPY, LATER, MAX_CHUNK, OK

_STATUS_TEXT = {1: "no such checkpoint", 2: "no such file", 3: "refused", 4: "error"}


class PeerSource(Source):
    """One peer execution replica's checkpoint files, over the wire (docs/wire.md 25/26).

    `target` is the server's principal (the peer's, or its host controld's): every request
    names it, and carries the challenge the server gave this connection, so that a
    captured request is refused anywhere else (docs/security.md "Snapshot file server").
    The first request on a connection gets the challenge and is sent again with it."""

    def __init__(
        self,
        name: str,
        addr: tuple[str, int],
        *,
        service: int,
        me: int,
        target: int,
        sign_key: SigningKey,
        timeout: float = 2.0,
    ) -> None:
        self.name = name
        self.addr = addr
        self.service = service
        self.me = me
        self.target = target
        self.sign_key = sign_key
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._challenge = b""  # the server's, for the connection in _sock
        self._lock = threading.Lock()  # one request at a time on the connection

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._challenge = b""

    def fetch(self, seq: int, path: str, size: int, sha256: bytes = NULL_DIGEST) -> bytes:
        out = bytearray()
        later = copy = False
        while True:
            data, total, status = self._chunk(seq, path, len(out), sha256)
            later = later or status == LATER
            copy = copy or status == COPY
            out += data
            if len(out) >= total:
                if later:
                    return LaterBytes(out)
                return CopyBytes(out) if copy else bytes(out)
            if not data:
                raise SourceError(f"{path}: empty chunk at {len(out)} of {total}")
            if len(out) > size + MAX_CHUNK:
                raise SourceError(f"{path}: more than the {size} bytes expected")

    def _chunk(self, seq: int, path: str, offset: int, sha256: bytes) -> tuple[bytes, int, int]:
        with self._lock:
            may_reconnect = True
            while True:
                kept = self._sock is not None
                try:
                    if self._sock is None:
                        self._sock = socket.create_connection(self.addr, timeout=self.timeout)
                        self._sock.settimeout(self.timeout)
                    req = wire.FileFetch(
                        self.service,
                        self.me,
                        seq,
                        path.encode(),
                        offset,
                        MAX_CHUNK,
                        self.target,
                        self._challenge,
                        sha256,
                    )
                    self._sock.sendall(wire.frame(req.signed(self.sign_key).encode()))
                    m = self._read_answer(seq, path.encode(), offset)
                except (OSError, wire.FrameError) as e:
                    self._drop()
                    # A kept connection may have died since its last use: one fresh try.
                    # Not after a timeout: a paused peer would cost the timeout twice.
                    if not (kept and may_reconnect) or isinstance(e, TimeoutError):
                        raise SourceError(f"{self.addr[0]}:{self.addr[1]}: {e}") from e
                    may_reconnect = False
                    continue
                if m.status != CHALLENGE:
                    break
                if self._challenge:  # a server that challenges the answer to its challenge
                    self._drop()
                    raise SourceError(f"{self.addr[0]}:{self.addr[1]}: challenged again")
                self._challenge = m.data  # this connection's: sign the request again
        if m.status not in (OK, LATER, COPY):
            raise SourceError(_STATUS_TEXT.get(m.status, f"status {m.status}"))
        return m.data, m.size, m.status

    def _read_answer(self, seq: int, path: bytes, offset: int) -> wire.FileData:
        assert self._sock is not None
        while True:
            (n,) = struct.unpack(">I", _recv_exact(self._sock, 4))
            if n < wire.HDR_LEN or n > wire.MAX_MSG:
                raise wire.FrameError(f"frame length {n}")
            body = _recv_exact(self._sock, n)
            try:
                m = wire.decode(body)
            except wire.WireError:
                continue  # garbage on the connection: skip it, the answer may follow
            if (
                isinstance(m, wire.FileData)
                and m.service == self.service
                and (m.seq, m.path, m.offset) == (seq, path, offset)
            ):
                return m


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)
