"""tests/test_guestbook_pages.py - the guestbook's paginated reads (docs/apps.md, guestbook):
page order and boundaries, 400s for bad parameters, determinism across replicas and hash
seeds, reads bounded by the page (not the book), the layout-1 migration, and the drill's
page-following reader of /entries.json."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlencode, urlsplit

import pytest

from zz.execution.app import ExecContext
from zz.execution.apps import guestbook as gb
from zz.execution.apps.wsgi import WsgiApp
from zz.execution.registry import create_app
from zz.execution.state import StateDir
from zz.httpop import HttpResponse, decode_response, encode_request

REPO = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000_000
FORM = [("content-type", "application/x-www-form-urlencoded")]


class CountingStateDir(StateDir):
    """A StateDir that records every path whose content is read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[str] = []

    def read_bytes(self, path: str) -> bytes:
        self.reads.append(path)
        return super().read_bytes(path)

    def open(self, path: str, mode: str = "rb", encoding: str | None = None) -> IO[Any]:
        if "r" in mode:
            self.reads.append(path)
        return super().open(path, mode, encoding)


def _book(root: Path, n: int = 0) -> WsgiApp:
    root.mkdir(parents=True)
    app = create_app("wsgi:guestbook")
    assert isinstance(app, WsgiApp)
    app.open(StateDir(root))
    for i in range(1, n + 1):
        gb.add_entry(app.state, f"n{i}", f"message {i}", T0 + i)
    app.state.take_dirty()
    return app


def _call(app: WsgiApp, target: str, method: str = "GET", seq: int = 1) -> HttpResponse:
    read_only = method in ("GET", "HEAD")
    ctx = ExecContext(seq, client=5, timestamp=seq, time_ms=T0 + seq, seed=3, read_only=read_only)
    op = encode_request(method, target)
    if read_only:
        with app.state.read_only():
            return decode_response(app.execute(op, ctx))
    return decode_response(app.execute(op, ctx))


def _ids(resp: HttpResponse) -> list[int]:
    assert resp.status == 200, resp.body
    return [e["id"] for e in json.loads(resp.body)]


def _html_ids(resp: HttpResponse) -> list[int]:
    assert resp.status == 200, resp.body
    return [int(i) for i in re.findall(r'<li id="e(\d+)"', resp.body.decode())]


# -- order and boundaries -----------------------------------------------------------------


def test_export_pages_newest_first_each_oldest_first(tmp_path: Path) -> None:
    app = _book(tmp_path / "s", 250)
    first = _call(app, "/entries.json")
    assert _ids(first) == list(range(151, 251))
    assert first.header("link") == '</entries.json?before=151>; rel="next"'
    # Following the links walks the whole book once, page by page, back to entry 1.
    seen: list[int] = []
    target: str | None = "/entries.json"
    pages = 0
    while target is not None:
        resp = _call(app, target)
        seen = _ids(resp) + seen
        pages += 1
        link = resp.header("link")
        target = re.fullmatch(r'<([^>]+)>; rel="next"', link).group(1) if link else None
    assert seen == list(range(1, 251)) and pages == 3
    # Every entry as stored, and the same bytes as one JSON array of them.
    assert (
        _call(app, "/entries.json?limit=1000").body == gb._dumps(gb.load_entries(app.state)) + b"\n"
    )


@pytest.mark.parametrize(
    "query, ids, link",
    [
        ("limit=1000", (1, 250), None),
        ("limit=1", (250, 250), '</entries.json?before=250&limit=1>; rel="next"'),
        ("limit=7&before=100", (93, 99), '</entries.json?before=93&limit=7>; rel="next"'),
        ("before=1", None, None),  # nothing is older than entry 1
        ("before=2", (1, 1), None),
        ("before=101", (1, 100), None),  # exactly the first chunk
        ("before=201", (101, 200), '</entries.json?before=101>; rel="next"'),
        ("before=250", (150, 249), '</entries.json?before=150>; rel="next"'),
        ("before=251", (151, 250), '</entries.json?before=151>; rel="next"'),  # = no before
        ("before=999999999999999999", (151, 250), '</entries.json?before=151>; rel="next"'),
        ("before=%35%30", (1, 49), None),  # percent-encoded digits are digits
        ("c=1&before=51&r=2", (1, 50), None),  # other parameters are ignored
    ],
)
def test_export_boundaries(tmp_path: Path, query: str, ids: Any, link: str | None) -> None:
    app = _book(tmp_path / "s", 250)
    resp = _call(app, f"/entries.json?{query}")
    assert _ids(resp) == (list(range(ids[0], ids[1] + 1)) if ids else [])
    assert resp.header("link") == link


def test_empty_book(tmp_path: Path) -> None:
    app = _book(tmp_path / "s")
    assert _call(app, "/entries.json").body == b"[]\n"
    assert _call(app, "/entries.json?before=5&limit=3").body == b"[]\n"
    page = _call(app, "/").body.decode()
    assert "<p>0 entries (none shown)</p>" in page and "<a href" not in page
    assert not app.state.take_dirty()


@pytest.mark.parametrize(
    "query, message",
    [
        ("before=0", "before must be at least 1, got 0"),
        ("before=-5", "before must be a decimal integer"),
        ("before=abc", "before must be a decimal integer"),
        ("before=", "before must be a decimal integer"),
        ("before=1.5", "before must be a decimal integer"),
        ("before=%D9%A3", "before must be a decimal integer"),  # an Arabic-Indic three
        ("before=1000000000000000000", "at most 18 digits"),
        ("limit=0", "limit must be between 1 and 1000, got 0"),
        ("limit=1001", "limit must be between 1 and 1000, got 1001"),
        ("limit=+5", "limit must be a decimal integer"),
        ("before=1&before=2", "parameter 'before' given more than once"),
        ("limit=5&limit=5", "parameter 'limit' given more than once"),
        ("before", "bad query string 'before'"),
        ("a=1&&b=2", "bad query string"),
    ],
)
@pytest.mark.parametrize("path", ["/", "/entries.json"])
def test_bad_parameters_get_400(tmp_path: Path, path: str, query: str, message: str) -> None:
    app = _book(tmp_path / "s", 3)
    resp = _call(app, f"{path}?{query}")
    assert resp.status == 400 and resp.header("content-type").startswith("text/plain")
    assert message in resp.body.decode()


def test_html_pages_and_links(tmp_path: Path) -> None:
    app = _book(tmp_path / "s", 250)
    newest = _call(app, "/")
    assert _html_ids(newest) == list(range(250, 150, -1))
    text = newest.body.decode()
    assert "<p>250 entries (#250 to #151 shown, newest first)</p>" in text
    assert '<a href="/?before=151">older entries</a>' in text and "newest entries" not in text
    middle = _call(app, "/?before=151").body.decode()
    assert _html_ids(_call(app, "/?before=151")) == list(range(150, 50, -1))
    assert '<a href="/">newest entries</a> | <a href="/?before=51">older entries</a>' in middle
    oldest = _call(app, "/?before=51")
    assert (
        _html_ids(oldest) == list(range(50, 0, -1)) and "older entries" not in oldest.body.decode()
    )
    small = _call(app, "/?before=30&limit=10").body.decode()
    assert '<a href="/?before=20&amp;limit=10">older entries</a>' in small
    assert '<a href="/?limit=10">newest entries</a>' in small
    assert _call(app, "/", "HEAD").header("content-length") == str(len(newest.body))


def test_post_writes_one_chunk_and_meta(tmp_path: Path) -> None:
    app = _book(tmp_path / "s", 250)
    form = urlencode({"name": "x", "message": "the 251st"}).encode()
    ctx = ExecContext(9, client=5, timestamp=9, time_ms=T0 + 9, seed=3)
    resp = decode_response(app.execute(encode_request("POST", "/", FORM, form), ctx))
    assert resp.status == 303 and resp.header("location") == "/#e251"
    dirty = app.state.take_dirty()
    assert dirty.written == {"guestbook/chunks/00000002.jsonl", "guestbook/meta.json"}
    assert not dirty.deleted
    chunk = app.state.read_bytes("guestbook/chunks/00000002.jsonl").splitlines()
    assert len(chunk) == 51 and json.loads(chunk[-1])["message"] == "the 251st"
    meta = app.state.read_bytes("guestbook/meta.json")
    assert len(meta) == gb.META_BYTES and meta.endswith(b" \n")
    assert json.loads(meta) == {
        "chunk_entries": 100,
        "count": 251,
        "layout": 2,
        "tail_bytes": len(app.state.read_bytes("guestbook/chunks/00000002.jsonl")),
    }


def test_post_cuts_off_a_torn_tail(tmp_path: Path) -> None:
    """Outside ZZ a killed write can leave bytes the meta file does not count; the next
    entry goes where the meta file says the chunk ends."""
    app = _book(tmp_path / "s", 120)
    path = tmp_path / "s" / "guestbook" / "chunks" / "00000001.jsonl"
    good = path.read_bytes()
    path.write_bytes(good + b'{"id":121,"mess')
    gb.add_entry(app.state, "x", "after the tear", T0)
    lines = path.read_bytes().splitlines()
    assert path.read_bytes().startswith(good) and len(lines) == 21
    assert json.loads(lines[-1])["message"] == "after the tear"
    assert [e["id"] for e in gb.load_entries(app.state)] == list(range(1, 122))


# -- reads bounded by the page --------------------------------------------------------------


@pytest.fixture(scope="module")
def book_2000(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gb") / "s"
    _book(root, 2000)
    return root


@pytest.mark.parametrize(
    "target, chunks",
    [
        ("/", [19]),
        ("/entries.json", [19]),
        ("/?before=1951", [18, 19]),
        ("/entries.json?before=1000", [8, 9]),
        ("/entries.json?before=2", [0]),
        ("/entries.json?before=1", []),
        ("/entries.json?before=1501&limit=1000", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]),
    ],
)
def test_a_page_reads_only_its_chunks(book_2000: Path, target: str, chunks: list[int]) -> None:
    """2,000 entries in 20 chunk files: a page reads meta.json and the chunks holding its
    entries, nothing else, and never parses more than a page of them."""
    app = create_app("wsgi:guestbook")
    assert isinstance(app, WsgiApp)
    state = CountingStateDir(book_2000)
    app.open(state)
    parsed = 0
    real_loads = json.loads

    def counting_loads(s: Any, *a: Any, **k: Any) -> Any:
        nonlocal parsed
        parsed += 1
        return real_loads(s, *a, **k)

    gb.json.loads = counting_loads  # type: ignore[attr-defined]
    try:
        resp = _call(app, target)
    finally:
        gb.json.loads = real_loads  # type: ignore[attr-defined]
    assert resp.status == 200
    assert state.reads == ["guestbook/meta.json"] + [
        f"guestbook/chunks/{k:08d}.jsonl" for k in chunks
    ]
    # meta.json, then the shown entries only for HTML; JSON joins the stored lines.
    shown = len(_ids(resp)) if "json" in target else len(_html_ids(resp))
    assert parsed == 1 + (shown if "json" not in target else 0)


# -- determinism ------------------------------------------------------------------------------


def _mixed_ops(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    ops = []
    for i in range(n):
        if rng.random() < 0.7:
            form = {"name": f"n{i}<&>", "message": rng.choice(["hi", "<i>x</i>", "é ü", "a&b"])}
            ops.append(encode_request("POST", "/", FORM, urlencode(form).encode()))
        else:
            q = rng.choice(["", "?limit=7", f"?before={rng.randrange(1, 400)}", "?limit=0"])
            ops.append(
                encode_request(rng.choice(["GET", "HEAD"]), rng.choice(["/", "/entries.json"]) + q)
            )
    return ops


def _run_ops(root: Path, ops: list[bytes]) -> tuple[str, dict[str, str]]:
    app = _book(root)
    digest = hashlib.sha256()
    for i, op in enumerate(ops):
        digest.update(app.execute(op, ExecContext(i + 1, 5, i + 1, T0 + 1000 * i, 77)))
    tree = {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    return digest.hexdigest(), tree


def test_replicas_agree_across_chunks(tmp_path: Path) -> None:
    ops = _mixed_ops(11, 500)
    a = _run_ops(tmp_path / "a", ops)
    b = _run_ops(tmp_path / "b", ops)
    assert a == b
    assert sum(1 for p in a[1] if p.startswith("guestbook/chunks/")) >= 3


_CHILD = """
import sys, json
from pathlib import Path
sys.path.insert(0, {tests!r})
import test_guestbook_pages as t
print(json.dumps(t._run_ops(Path(sys.argv[1]), t._mixed_ops(12, 300))))
"""


def test_same_replies_under_other_hash_seeds(tmp_path: Path) -> None:
    """str hashes (so set order) differ between processes; replies and files must not."""
    out = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        code = _CHILD.format(tests=str(REPO / "tests"))
        r = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / seed)],
            env=env, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        out.append(json.loads(r.stdout))
    assert out[0] == out[1]


# -- migration from layout 1 ------------------------------------------------------------------


def _layout_1(root: Path, n: int) -> None:
    """A guestbook as the layout-1 code wrote it: index.json and one file per entry."""
    (root / "guestbook" / "entries").mkdir(parents=True)
    for i in range(1, n + 1):
        e = {"id": i, "message": f"old <{i}>", "name": "é", "time_ms": T0 + i}
        (root / "guestbook" / "entries" / f"{i:08d}.json").write_bytes(gb._dumps(e))
    index = {"ids": list(range(1, n + 1)), "next_id": n + 1}
    (root / "guestbook" / "index.json").write_bytes(gb._dumps(index))


def test_layout_1_is_migrated_by_the_first_ordered_request(tmp_path: Path) -> None:
    root = tmp_path / "s"
    root.mkdir()
    _layout_1(root, 230)
    old = {"id": 7, "message": "old <7>", "name": "é", "time_ms": T0 + 7}
    app = create_app("wsgi:guestbook")
    assert isinstance(app, WsgiApp)
    app.open(StateDir(root))
    # Read-only, it cannot migrate: the adapter asks for the request to be resent ordered.
    ro = _call(app, "/entries.json")
    assert ro.status == 503 and ro.header("zz-read-only") == "rejected"
    assert not app.state.take_dirty() and (root / "guestbook" / "index.json").exists()
    # Ordered (the proxy's resend), it migrates and answers from the new layout.
    ctx = ExecContext(2, client=5, timestamp=2, time_ms=T0, seed=3)
    resp = decode_response(
        app.execute(encode_request("GET", "/entries.json?before=8&limit=1"), ctx)
    )
    assert resp.status == 200 and json.loads(resp.body) == [old]
    dirty = app.state.take_dirty()
    assert dirty.written == {
        "guestbook/meta.json",
        "guestbook/chunks/00000000.jsonl",
        "guestbook/chunks/00000001.jsonl",
        "guestbook/chunks/00000002.jsonl",
    }
    assert len(dirty.deleted) == 231 and "guestbook/index.json" in dirty.deleted
    assert sorted(p.name for p in (root / "guestbook").iterdir()) == ["chunks", "meta.json"]
    assert [e["id"] for e in gb.load_entries(app.state)] == list(range(1, 231))
    # Ids continue where layout 1 stopped.
    form = urlencode({"message": "new"}).encode()
    post = app.execute(encode_request("POST", "/", FORM, form), ExecContext(3, 5, 3, T0, 3))
    assert decode_response(post).header("location") == "/#e231"


def test_migration_is_deterministic_and_resumes(tmp_path: Path) -> None:
    trees = []
    for name in ("a", "b"):
        root = tmp_path / name
        root.mkdir()
        _layout_1(root, 120)
        app = create_app("wsgi:guestbook")
        assert isinstance(app, WsgiApp)
        app.open(StateDir(root))
        assert _call(app, "/nope", "POST").status == 404  # any ordered request migrates
        trees.append(
            {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        )
    assert trees[0] == trees[1]
    # Killed after meta.json but before the old files were gone: the next request deletes
    # them and keeps the migrated entries.
    root = tmp_path / "c"
    root.mkdir()
    _layout_1(root, 120)
    for rel, data in trees[0].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    app = create_app("wsgi:guestbook")
    assert isinstance(app, WsgiApp)
    app.open(StateDir(root))
    assert _call(app, "/x", "POST").status == 404
    assert app.state.take_dirty().deleted == {"guestbook/index.json"} | {
        f"guestbook/entries/{i:08d}.json" for i in range(1, 121)
    }
    files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert files == trees[0]
    assert _ids(_call(app, "/entries.json?limit=1000")) == list(range(1, 121))


def test_bad_layout_1_index_is_a_500_not_a_guess(tmp_path: Path) -> None:
    root = tmp_path / "s"
    root.mkdir()
    _layout_1(root, 3)
    (root / "guestbook" / "index.json").write_bytes(gb._dumps({"ids": [1, 3], "next_id": 4}))
    app = create_app("wsgi:guestbook")
    assert isinstance(app, WsgiApp)
    app.open(StateDir(root))
    assert _call(app, "/", "POST").status == 500
    assert (root / "guestbook" / "index.json").exists() and not (
        root / "guestbook" / "meta.json"
    ).exists()


# -- the drill's reader of every entry -----------------------------------------------------


async def _serve_wsgi(state: StateDir) -> asyncio.Server:
    """A minimal keep-alive HTTP/1.1 server calling the guestbook in process."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            method, target, _ = line.decode().split()
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            url = urlsplit(target)
            env = {"REQUEST_METHOD": method, "PATH_INFO": url.path, "QUERY_STRING": url.query,
                   "wsgi.input": io.BytesIO(), "zz.state": state, "zz.time_ms": T0}  # fmt: skip
            got: list[Any] = []
            body = b"".join(gb.application(env, lambda s, h, got=got: got.extend([s, h])))
            writer.write(f"HTTP/1.1 {got[0]}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            writer.write(body)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("n", [0, 1, 999, 1000, 1001, 2001])
async def test_drill_reads_every_entry_page_by_page(tmp_path: Path, n: int) -> None:
    from zz.drill.load import entries

    app = _book(tmp_path / "s", n)
    server = await _serve_wsgi(app.state)
    try:
        port = server.sockets[0].getsockname()[1]
        got = await entries(f"http://127.0.0.1:{port}/")
    finally:
        server.close()
    assert [e["id"] for e in got] == list(range(1, n + 1))
    assert got == gb.load_entries(app.state)
