# zz/history.py - record kv operation histories through the ZZ client and get a
# linearizability verdict from tools/lincheck (Porcupine). Format: docs/linearizability.md.
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from zz import kvop

LINCHECK_SRC = Path(__file__).resolve().parent.parent / "tools" / "lincheck"
_SOURCES = ("main.go", "go.mod", "go.sum")
_STATUS = {kvop.OK: "ok", kvop.NOT_FOUND: "not_found", kvop.CAS_MISMATCH: "mismatch"}
EXIT_OK, EXIT_ILLEGAL, EXIT_BAD_INPUT, EXIT_UNKNOWN = 0, 1, 2, 3


class LincheckError(Exception):
    """tools/lincheck cannot be built or run, or it rejected the history as bad input."""


class LincheckMissing(LincheckError):
    """tools/lincheck is not built and the caller asked not to build it (a drill: the
    checker is built at set-up, scripts/setup.sh, never on the clock of a drill)."""


# How to build the checker, for messages.
BUILD_HINT = (
    "bash scripts/setup.sh, or `python3 -m zz.history --build` (needs Go: scripts/setup-go.sh)"
)


# Keys and values are bytes, JSON has only text: latin-1 maps each byte to one code point,
# so the mapping is exact both ways and ASCII stays readable in the file.
def _text(b: bytes | None) -> str | None:
    return None if b is None else b.decode("latin-1")


def _bytes(s: str | None) -> bytes | None:
    return None if s is None else s.encode("latin-1")


@dataclass
class Output:
    status: str  # ok, not_found, mismatch, error
    value: bytes | None = None  # get ok: the value; mismatch: the current value
    present: bool | None = None  # mismatch: whether the key exists

    @classmethod
    def from_reply(cls, op: str, reply: kvop.KvReply) -> Output:
        status = _STATUS.get(reply.status, "error")
        if status == "mismatch":
            return cls(status, reply.value, reply.present)
        if op == "get" and status == "ok":
            return cls(status, reply.value)
        return cls(status)


@dataclass
class Op:
    """One operation: `ret`/`output` None while (or because) it never returned."""

    client: int
    call: int
    op: str  # get, put, delete, cas, append
    key: bytes
    value: bytes | None = None  # put/append value, cas new value
    expected: bytes | None = None  # cas only; None there means "the key is absent"
    ret: int | None = None
    output: Output | None = None

    @property
    def pending(self) -> bool:
        return self.output is None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"client": self.client, "call": self.call, "op": self.op}
        d["key"] = _text(self.key)
        if self.value is not None:
            d["value"] = _text(self.value)
        if self.op == "cas" and self.expected is not None:
            d["expected"] = _text(self.expected)
        d["return"] = self.ret
        if self.output is None:
            d["output"] = None
        else:
            out: dict[str, Any] = {"status": self.output.status}
            if self.output.value is not None:
                out["value"] = _text(self.output.value)
            if self.output.present is not None:
                out["present"] = self.output.present
            d["output"] = out
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Op:
        out = d.get("output")
        return cls(
            client=d["client"],
            call=d["call"],
            op=d["op"],
            key=_bytes(d["key"]) or b"",
            value=_bytes(d.get("value")),
            expected=_bytes(d.get("expected")),
            ret=d.get("return"),
            output=None
            if out is None
            else Output(out["status"], _bytes(out.get("value")), out.get("present")),
        )


@dataclass
class History:
    operations: list[Op] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"operations": [o.to_json() for o in self.operations]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=None, separators=(",", ":"))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(self.dumps() + "\n")
        return p

    @classmethod
    def from_json(cls, data: dict[str, Any] | list[dict[str, Any]]) -> History:
        ops = data if isinstance(data, list) else data["operations"]
        return cls([Op.from_json(o) for o in ops])

    @classmethod
    def load(cls, path: str | Path) -> History:
        return cls.from_json(json.loads(Path(path).read_text()))


class KvInvoker(Protocol):
    """What the recorder needs of a client: zz.client.Client fits."""

    async def invoke(self, op: bytes, read_only: bool = False, timeout: float = 30.0) -> bytes: ...


class HistoryRecorder:
    """Collects the operations of any number of RecordingKvClients. One clock for all of
    them, so call/return times are comparable across clients; a monotonic clock, so a
    wall-clock step cannot reorder them."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.clock = clock
        self.operations: list[Op] = []
        self._next_process = 0

    def new_process(self) -> int:
        p = self._next_process
        self._next_process += 1
        return p

    def begin(
        self,
        process: int,
        op: str,
        key: bytes,
        value: bytes | None = None,
        expected: bytes | None = None,
    ) -> Op:
        rec = Op(process, self.clock(), op, key, value, expected)
        self.operations.append(rec)
        return rec

    def finish(self, rec: Op, reply: kvop.KvReply) -> None:
        rec.ret = self.clock()
        rec.output = Output.from_reply(rec.op, reply)

    def history(self) -> History:
        return History(list(self.operations))

    def client(self, invoker: KvInvoker, timeout: float = 30.0) -> RecordingKvClient:
        return RecordingKvClient(invoker, self, timeout)


class RecordingKvClient:
    """kv operations over one client, each recorded with its call and return time.

    Use it sequentially (zz.client.Client runs one request at a time anyway; queueing
    behind its lock would only widen the recorded intervals). An op that raises (timeout,
    undecodable reply, cancellation) stays pending: it may still take effect later."""

    def __init__(self, invoker: KvInvoker, recorder: HistoryRecorder, timeout: float = 30.0):
        self.invoker = invoker
        self.recorder = recorder
        self.timeout = timeout
        self.process = recorder.new_process()

    async def _run(
        self,
        kind: str,
        op: bytes,
        key: bytes,
        value: bytes | None = None,
        expected: bytes | None = None,
    ) -> kvop.KvReply:
        rec = self.recorder.begin(self.process, kind, key, value, expected)
        try:
            raw = await self.invoker.invoke(op, read_only=kind == "get", timeout=self.timeout)
            reply = kvop.decode_reply(raw)
        except BaseException:
            # The pending op is still "in flight" forever; later ops come from a fresh
            # process id so that no process has two overlapping ops (Jepsen's rule,
            # and what keeps Porcupine's per-client visualization readable).
            self.process = self.recorder.new_process()
            raise
        self.recorder.finish(rec, reply)
        return reply

    async def get(self, key: bytes) -> kvop.KvReply:
        return await self._run("get", kvop.encode_get(key), key)

    async def put(self, key: bytes, value: bytes) -> kvop.KvReply:
        return await self._run("put", kvop.encode_put(key, value), key, value)

    async def delete(self, key: bytes) -> kvop.KvReply:
        return await self._run("delete", kvop.encode_delete(key), key)

    async def cas(self, key: bytes, expected: bytes | None, new: bytes) -> kvop.KvReply:
        return await self._run("cas", kvop.encode_cas(key, expected, new), key, new, expected)

    async def append(self, key: bytes, value: bytes) -> kvop.KvReply:
        return await self._run("append", kvop.encode_append(key, value), key, value)


# ---- the checker --------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    result: str  # Porcupine's CheckResult: "Ok", "Illegal" or "Unknown" (timed out)
    operations: int
    pending: int
    keys: int
    bad_keys: list[bytes]
    html: Path | None = None

    @property
    def linearizable(self) -> bool:
        return self.result == "Ok"

    def __str__(self) -> str:
        word = {"Ok": "linearizable", "Illegal": "NOT linearizable"}.get(self.result, "unknown")
        s = f"{word}: {self.operations} operations ({self.pending} pending) on {self.keys} keys"
        if self.bad_keys:
            s += "; keys with no linearization: " + ", ".join(repr(k) for k in self.bad_keys)
        if self.html:
            s += f"; visualization {self.html}"
        return s


def _cache_root() -> Path:
    env = os.environ.get("ZZ_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "zz"


def lincheck_binary(cache_dir: str | Path | None = None, build: bool = True) -> Path:
    """The built tools/lincheck, built now if it is not (`build`; else LincheckMissing).
    ZZ_LINCHECK names a prebuilt binary. scripts/setup.sh builds it (`--build` below).

    The binary is named after a hash of its sources, so editing main.go or bumping
    Porcupine in go.mod rebuilds instead of running a stale checker."""
    env = os.environ.get("ZZ_LINCHECK")
    if env:
        if not build and not os.access(env, os.X_OK):
            raise LincheckMissing(f"ZZ_LINCHECK={env} is not an executable file")
        return Path(env)
    try:
        h = hashlib.sha256()
        for name in _SOURCES:
            h.update(name.encode() + b"\0" + (LINCHECK_SRC / name).read_bytes() + b"\0")
    except OSError as e:
        raise LincheckError(f"tools/lincheck sources not found ({e}); set ZZ_LINCHECK") from e
    out_dir = Path(cache_dir) if cache_dir is not None else _cache_root() / "lincheck"
    binary = out_dir / f"lincheck-{h.hexdigest()[:16]}"
    if binary.exists():
        return binary
    if not build:
        raise LincheckMissing(
            f"tools/lincheck (Porcupine) is not built for these sources (no {binary}): {BUILD_HINT}"
        )
    go = shutil.which("go")
    if go is None:
        raise LincheckError("no `go` on PATH: run scripts/setup-go.sh")
    out_dir.mkdir(parents=True, exist_ok=True)
    # A private temporary name, then an atomic rename: parallel first uses (pytest -n)
    # each build, and none ever runs a half-written binary.
    fd, tmp = tempfile.mkstemp(prefix=".lincheck-", dir=out_dir)
    os.close(fd)
    try:
        # -mod=readonly: go.sum must already pin Porcupine; the download goes through
        # the default module proxy (GOPROXY is left as the environment has it).
        proc = subprocess.run(
            [go, "build", "-mod=readonly", "-trimpath", "-o", tmp, "."],
            cwd=LINCHECK_SRC,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise LincheckError(f"go build tools/lincheck failed:\n{proc.stderr}")
        os.replace(tmp, binary)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return binary


def check(
    history: History,
    html: str | Path | None = None,
    timeout: float | None = None,
    cache_dir: str | Path | None = None,
    build: bool = True,
) -> Verdict:
    """Porcupine's verdict on `history`. `html`: also write the visualization there.
    `timeout` (seconds): give up with result "Unknown" rather than search for ever.
    `build`: build the checker if it is not (else LincheckMissing)."""
    binary = lincheck_binary(cache_dir, build=build)
    args = [str(binary), "-json"]
    if html is not None:
        args += ["-html", str(html)]
    if timeout is not None:
        args += ["-timeout", f"{int(timeout * 1000)}ms"]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(history.dumps())
        path = f.name
    try:
        proc = subprocess.run(args + [path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    if proc.returncode not in (EXIT_OK, EXIT_ILLEGAL, EXIT_UNKNOWN):
        raise LincheckError(f"lincheck exit {proc.returncode}: {proc.stderr.strip()}")
    v = json.loads(proc.stdout)
    return Verdict(
        result=v["result"],
        operations=v["operations"],
        pending=v["pending"],
        keys=v["keys"],
        bad_keys=[k.encode("latin-1") for k in v["bad_keys"]],
        html=Path(v["html"]) if v.get("html") else None,
    )


def main(argv: list[str] | None = None) -> int:
    """python3 -m zz.history HISTORY.json [--html OUT.html] [--timeout SECONDS], or
    python3 -m zz.history --build: build tools/lincheck now (scripts/setup.sh does)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python3 -m zz.history", description=main.__doc__)
    ap.add_argument("history", nargs="?")
    ap.add_argument("--html")
    ap.add_argument("--timeout", type=float)
    ap.add_argument("--build", action="store_true", help="build the checker, print its path")
    a = ap.parse_args(argv)
    if a.build:
        try:
            print(lincheck_binary())
        except LincheckError as e:
            print(f"zz.history: {e}", file=sys.stderr)
            return 1
        return 0
    if a.history is None:
        ap.error("HISTORY.json or --build")
    try:
        verdict = check(History.load(a.history), a.html, a.timeout)
    except (LincheckError, OSError, ValueError, KeyError) as e:
        print(f"zz.history: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(verdict)
    return {"Ok": EXIT_OK, "Illegal": EXIT_ILLEGAL}.get(verdict.result, EXIT_UNKNOWN)


if __name__ == "__main__":
    sys.exit(main())
