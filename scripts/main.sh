#!/usr/bin/env bash
# main.sh - the main job: set up, run one 4-replica agreement cluster under client load,
# kill its primary as a fault drill, and report the view change and continued service.
set -euo pipefail

cd "$(dirname "$0")/.."
bash scripts/setup.sh

PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/zz-main.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

echo "[main] cluster in $WORK"
ZZ_AGREED=${ZZ_AGREED:-agreement/build/zz-agreed} "$PY" - "$WORK" <<'PYEOF'
# The drill itself: tests/cluster.py starts and always stops the replicas.
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
from tests.cluster import Cluster  # noqa: E402

PHASE_S = 5.0
CLIENTS = 4


async def workload(c: Cluster, log: list[tuple[float, float]], stop: asyncio.Event) -> None:
    async def one(i: int) -> None:
        cl = c.client(i)
        k = 0
        try:
            while not stop.is_set():
                op = f"main-c{i}-{k}".encode()
                issued = time.monotonic()
                res = await cl.invoke(op, timeout=60)
                if res != op:
                    raise SystemExit(f"client {i}: wrong result {res!r} for {op!r}")
                log.append((issued, time.monotonic()))
                k += 1
        finally:
            await cl.close()

    await asyncio.gather(*(one(i) for i in range(CLIENTS)))


async def drill(c: Cluster) -> dict:
    log: list[tuple[float, float]] = []
    stop = asyncio.Event()
    task = asyncio.create_task(workload(c, log, stop))
    t_start = time.monotonic()
    await asyncio.sleep(PHASE_S)
    primary = c.stats(1, fresh=False)["view"] % c.n
    before = len(log)
    print(f"[main] {before} requests in {PHASE_S:.0f} s; killing primary r{primary}", flush=True)
    t_fault = time.monotonic()
    c.kill(primary)
    await asyncio.sleep(PHASE_S * 2)
    stop.set()
    await task
    # Requests issued after the fault: their first reply is the recovery time (a request
    # already committed before the kill could still complete at once).
    after = sorted(done for issued, done in log if issued > t_fault)
    span = (after[-1] - after[0]) if len(after) > 1 else 0.0
    return {
        "primary": primary,
        "before": before,
        "before_rate": before / (t_fault - t_start),
        "after": len(after),
        "first_reply_s": (after[0] - t_fault) if after else None,
        "after_rate": (len(after) - 1) / span if span > 0 else 0.0,
    }


c = Cluster(Path(sys.argv[1]), g=1, view_timeout_ms=500)
with c:
    c.start()
    print(f"[main] 4 replicas (g=1) on 127.0.0.1:{c.base_port}..{c.base_port + 3}, "
          f"binary {c.binary}", flush=True)
    rep = asyncio.run(drill(c))
    survivors = [r for r in range(c.n) if r != rep["primary"]]
    c.wait_for(lambda: len({c.stats(r)["last_exec"] for r in survivors}) == 1, timeout=10,
               what="survivors agree on last_exec")
    print("\n==== fault drill: agreement primary crash ====")
    print(f"requests before the fault : {rep['before']} ({rep['before_rate']:.0f}/s)")
    print(f"requests issued after it  : {rep['after']}")
    fr = rep["first_reply_s"]
    print("time to first reply after : " + (f"{fr * 1000:.0f} ms" if fr is not None else "NONE"))
    print(f"throughput after recovery : {rep['after_rate']:.0f}/s")
    print("replicas now:")
    print(c.summary())
    views = {c.stats(r)["view"] for r in survivors}
    ok = fr is not None and rep["after"] > 0 and min(views) >= 1
    print(f"view change {'observed' if min(views) >= 1 else 'NOT observed'}: views {sorted(views)}")
    print(f"RESULT: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PYEOF
echo "[main] torn down"
