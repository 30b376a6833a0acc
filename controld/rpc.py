# controld/rpc.py - the controld RPC on the wire: CONTROL (operator -> controld) and
# CONTROL-REPLY (controld -> operator), MAC-authenticated, framed per docs/wire.md. The
# client side (`zz controld`, tests) and the reply encoding the daemon uses.
"""CONTROL / CONTROL-REPLY (docs/wire.md types 23, 24; docs/controld.md "RPC").

A request is one CONTROL message: `request_id` (strictly increasing per operator; the
client uses time.time_ns()) and a JSON object `{"op": ..., ...}`. controld answers with
one or more CONTROL-REPLY messages carrying the same request id: zero or more progress
replies `{"ok": true, "final": false, "progress": "..."}` and one final reply
`{"ok": bool, "final": true, ...}` (`error` says why when ok is false).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

from zz import wire

RACK_SERVICE = 0


class RpcError(Exception):
    """The RPC could not be completed (connection, framing, authentication)."""


def encode_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# No request nests more than a few levels; json.loads recurses once per level and a
# deep enough document raises RecursionError, so depth is checked before parsing.
MAX_JSON_DEPTH = 32
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKETS = re.compile(r"[\[\]{}]")


class JsonTooDeep(ValueError):
    pass


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in `text` (brackets inside strings do not count);
    linear, with no recursion, so it is safe on any input."""
    depth = deepest = 0
    for b in _JSON_BRACKETS.findall(_JSON_STRING.sub("", text)):
        depth += 1 if b in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def decode_json(data: bytes) -> dict[str, Any]:
    """The JSON object of a CONTROL/CONTROL-REPLY; ValueError if it is not one (JsonTooDeep
    if it nests deeper than MAX_JSON_DEPTH). Python's json takes NaN and Infinity: each op
    checks its numeric fields, naming the field."""
    text = data.decode("utf-8")
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise JsonTooDeep(f"json nested {depth} deep, more than {MAX_JSON_DEPTH}")
    try:
        obj = json.loads(text)
    except RecursionError:  # not expected past the depth check; never let it escape
        raise JsonTooDeep(f"json nested too deep for the parser (> {MAX_JSON_DEPTH})") from None
    if not isinstance(obj, dict):
        raise ValueError("json body is not an object")
    return obj


def control_reply(
    sender: int, receiver: int, key: bytes, request_id: int, body: dict[str, Any]
) -> bytes:
    """A framed, MAC'd CONTROL-REPLY for one operator."""
    msg = wire.ControlReply(RACK_SERVICE, sender, request_id, encode_json(body))
    return wire.frame(msg.with_macs({receiver: key}).encode())


def control_request(
    sender: int, receiver: int, key: bytes, request_id: int, body: dict[str, Any]
) -> bytes:
    msg = wire.Control(RACK_SERVICE, sender, request_id, encode_json(body))
    return wire.frame(msg.with_macs({receiver: key}).encode())


async def call(
    address: str,
    port: int,
    *,
    operator: int,
    controld: int,
    key: bytes,
    op: dict[str, Any],
    request_id: int | None = None,
    timeout: float = 600.0,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Send one CONTROL request and return the final reply's JSON. Progress replies go to
    `progress`. Replies that fail the MAC, name another request or another sender are
    ignored (counted in the returned reply's `_ignored`)."""
    rid = time.time_ns() if request_id is None else request_id
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address, port), 10.0)
    except (TimeoutError, OSError) as e:
        raise RpcError(f"cannot connect to controld at {address}:{port}: {e}") from e
    ignored = 0
    try:
        writer.write(control_request(operator, controld, key, rid, op))
        await writer.drain()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RpcError(f"no final reply from controld within {timeout:.0f} s")
            try:
                raw = await asyncio.wait_for(wire.read_frame(reader), left)
            except asyncio.IncompleteReadError as e:
                raise RpcError("controld closed the connection without a final reply") from e
            except wire.FrameError as e:
                raise RpcError(f"controld sent a bad frame: {e}") from e
            except TimeoutError:
                continue
            try:
                m = wire.decode(raw)
            except wire.WireError:
                ignored += 1
                continue
            if (
                not isinstance(m, wire.ControlReply)
                or m.sender != controld
                or m.request_id != rid
                or not m.verify_mac(operator, key)
            ):
                ignored += 1
                continue
            try:
                body = decode_json(m.json)
            except ValueError:
                ignored += 1
                continue
            if body.get("final", True):
                if ignored:
                    body["_ignored"] = ignored
                return body
            if progress is not None:
                progress(body)
    except OSError as e:
        raise RpcError(f"controld connection: {e}") from e
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
