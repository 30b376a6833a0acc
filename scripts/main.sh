#!/usr/bin/env bash
# main.sh - the main job: set up, then run a BFT web app (the guestbook on 4 agreement +
# 2 execution replicas behind `zz proxy`), use it with curl, crash the agreement primary
# under HTTP load and print a drill report ending in RESULT: PASS/FAIL (scripts/demo_web.py).
# Idempotent: leftovers of an earlier, interrupted run (processes, temp dirs) are removed
# first; ports are picked free on every run.
set -euo pipefail

cd "$(dirname "$0")/.."
bash scripts/setup.sh

PY=${PYTHON:-python3}
PREFIX=/tmp/zz-main.

# One main job at a time on this machine: the cleanup below must not hit a running one.
exec 9>/tmp/zz-main-lock
if ! flock -w 300 9; then
    echo "[main] another scripts/main.sh holds /tmp/zz-main-lock; giving up" >&2
    exit 1
fi

# Processes of ours whose command line names a path starting with $1 (zz-agreed --conf,
# python -m zz.execution --rack, zz proxy, demo_web.py): SIGKILL by pid, with their
# process groups (each replica and the proxy lead their own). Prints how many.
kill_named() {
    local d pid cmd n=0
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        [ "$pid" = "$$" ] && continue
        cmd=$(tr '\0' ' ' <"$d/cmdline" 2>/dev/null) || continue
        case "$cmd" in
        *"$1"*)
            case "$cmd" in
            *zz-agreed* | *zz.execution* | *"zz proxy"* | *demo_web.py* | *tests.cluster*)
                kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
                n=$((n + 1))
                ;;
            esac
            ;;
        esac
    done
    [ "$n" -eq 0 ] || sleep 0.5
    echo "$n"
}

# Leftovers of an interrupted run: its processes, then its temp dirs.
cleanup_leftovers() {
    local d n
    n=$(kill_named "$PREFIX")
    [ "$n" -eq 0 ] || echo "[main] killed $n leftover process(es) of an earlier run"
    for d in "$PREFIX"*/; do
        [ -d "$d" ] || continue
        echo "[main] removing leftover ${d%/}"
        rm -rf "$d"
    done
}
cleanup_leftovers

WORK=$(mktemp -d "${PREFIX}XXXXXX")
# demo_web.py stops the proxy and every replica itself (also on errors, Ctrl-C, SIGTERM);
# should it die without doing so, whatever still names $WORK goes here.
finish() {
    local n
    n=$(kill_named "$WORK")
    [ "$n" -eq 0 ] || echo "[main] killed $n process(es) the demo left behind"
    rm -rf "$WORK"
}
trap finish EXIT
echo "[main] work dir $WORK"

rc=0
ZZ_AGREED=${ZZ_AGREED:-agreement/build/zz-agreed} "$PY" scripts/demo_web.py "$WORK" || rc=$?
echo "[main] done, exit status $rc"
exit "$rc"
