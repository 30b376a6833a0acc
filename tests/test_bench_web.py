# tests/test_bench_web.py - the parts of scripts/bench/web that need no rack: its wrk Lua
# script against a small local HTTP server (1 s of wrk, skipped without wrk), the parsing of
# wrk's result line, the per-mix summary and ratios, and its rack (web only; durable with
# --durability). ~2 s.
from __future__ import annotations

import importlib.machinery
import importlib.util
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from zz.config import load
from zz.powerloss import write_rack
from zz.render import replica_conf

REPO = Path(__file__).resolve().parent.parent


def _bench() -> ModuleType:
    path = REPO / "scripts" / "bench" / "web"
    loader = importlib.machinery.SourceFileLoader("bench_web", str(path))
    spec = importlib.util.spec_from_loader("bench_web", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


web = _bench()

LINE = (
    'ZZ-WRK {"requests":1000,"duration_us":2000000,"bytes":5,"connect_errors":0,'
    '"read_errors":1,"write_errors":0,"status_errors":2,"timeouts":0,"p50_us":4000,'
    '"p90_us":9000,"p99_us":12500,"mean_us":4500.5,"max_us":30000}'
)


def test_parse_wrk() -> None:
    r = web.parse_wrk("Running 2s test @ http://x/\n" + LINE + "\n")
    assert r["requests"] == 1000 and r["req_per_s"] == 500.0
    assert (r["p50_ms"], r["p99_ms"], r["max_ms"]) == (4.0, 12.5, 30.0)
    assert r["errors"] == 3 and r["error_detail"] == {"read_errors": 1, "status_errors": 2}


@pytest.mark.parametrize(
    "out",
    [
        "no result\n",
        LINE + "\n" + LINE,
        "ZZ-WRK {not json",
        'ZZ-WRK {"requests":1}',
        LINE.replace('"duration_us":2000000', '"duration_us":0'),
    ],  # fmt: skip
)
def test_parse_wrk_refuses(out: str) -> None:
    with pytest.raises(web.BenchError):
        web.parse_wrk(out)


def _row(rnd: int, side: str, rate: float, mix: str = "post") -> dict[str, Any]:
    return {"round": rnd, "mix": mix, "side": side, "req_per_s": rate, "p50_ms": 1.0,
            "p99_ms": 2.0, "errors": 0}  # fmt: skip


def test_summarize_ratios_per_round() -> None:
    rows = [_row(0, "zz", 200), _row(0, "gunicorn", 800), _row(1, "gunicorn", 500),
            _row(1, "zz", 250), _row(0, "zz", 10, "get")]  # fmt: skip
    s = web.summarize(rows)
    assert s["post"]["ratios"] == [0.25, 0.5]
    assert s["post"]["ratio_median"] == 0.375
    assert s["post"]["zz"]["req_per_s"] == 225 and s["post"]["gunicorn"]["req_per_s"] == 650
    assert s["get"]["ratios"] == [] and s["get"]["ratio_median"] is None


def test_summarize_guest_ratios() -> None:
    """--backend libvirt: each guests' rack against the process rack, per round."""
    rows = [_row(0, "zz", 200), _row(0, "guests", 4), _row(0, "guests2", 10),
            _row(0, "gunicorn", 400), _row(1, "guests", 3), _row(1, "zz", 100),
            _row(1, "guests2", 5)]  # fmt: skip
    s = web.summarize(rows)["post"]
    assert s["guest_ratios"] == [0.02, 0.03] and s["guest_ratio_median"] == 0.025
    assert s["guests2_ratios"] == [0.05, 0.05] and s["ratios"] == [0.5]
    assert web.guest_sides(list(s)) == ["guests", "guests2"]


def test_parse_variant() -> None:
    assert web.parse_variant("default") == {}
    assert web.parse_variant("cache=loose,cp=256") == {"cache": "loose", "cp": "256"}
    for bad in ("cache", "colour=red", "cpu="):
        with pytest.raises(ValueError):
            web.parse_variant(bad)


def test_rack_is_web_only(tmp_path: Path) -> None:
    cfg = load(write_rack(tmp_path, "w", durability="off", kv=False))
    assert [(s.name, s.id, s.app, s.f) for s in cfg.services] == [("web", 1, "wsgi:guestbook", 1)]


def test_durable_rack_renders_no_max_inflight(tmp_path: Path) -> None:
    # --durability fsync: the replicas sync a log and, without --set max_inflight=N, get
    # zz-agreed's durable default (one batch in flight) rather than a rendered value.
    cfg = load(write_rack(tmp_path, "w", durability="fsync", kv=False))
    keys = {ln.split()[0] for ln in replica_conf(cfg, cfg.services[0], 0).splitlines()}
    assert {"data_dir", "durability"} <= keys and "max_inflight" not in keys
    four = replica_conf(cfg, cfg.services[0], 0, {"max_inflight": 4}).splitlines()
    assert "max_inflight 4" in four


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, bytes]] = []

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(("POST", self.path, body))
        self._answer(303, b"added\n")

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append(("GET", self.path, b""))
        self._answer(200, b"[]\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed (scripts/setup.sh)")
def test_lua_script_under_wrk(tmp_path: Path) -> None:
    """The real wrk runs WRK_LUA's mix and prints the line parse_wrk reads."""
    script = tmp_path / "bench.lua"
    script.write_text(web.WRK_LUA)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        args = web.argparse.Namespace(threads=1, connections=1, seconds=1)
        r = web.run_wrk(url, "mix", args, script)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert r["requests"] >= 10 and r["errors"] == 0
    seen = _Handler.seen
    posts = [s for s in seen if s[0] == "POST"]
    assert {s[1] for s in posts} == {"/"} and posts[0][2].startswith(b"name=bench&message=")
    assert {s[1] for s in seen if s[0] == "GET"} == {"/entries.json"}
    assert len(posts) > len(seen) // 2
