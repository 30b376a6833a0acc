#!/usr/bin/env bash
# test.sh - the project's whole test suite, the command the README and CI run.
# Lint (ruff; the import layers of docs/layout.md), C unit tests and short fuzz runs (two
# targets, FUZZ_SECONDS each, 10 s by default: a smoke run of the checked-in corpus and what
# it finds at once; longer runs: `make -C agreement fuzz-run FUZZ_SECONDS=600`), then pytest
# without the tests marked `long` (whose summary line ends the output). ZZ_SETUP_DONE=1
# skips the set-up (.ci/run has just run it).
# test.sh --long: set-up, then only the `long` tests (the real-VM drills on racks of their
# own, ~10 min on the 2-core development machine; README "Tests", docs/operations.md).
set -euo pipefail

cd "$(dirname "$0")/.."
long=0
case "${1:-}" in
  "") ;;
  --long) long=1 ;;
  *) echo "usage: $0 [--long]" >&2; exit 2 ;;
esac
[ "${ZZ_SETUP_DONE:-}" = 1 ] || bash scripts/setup.sh

PY=${PYTHON:-python3}
if [ "$long" = 1 ]; then
  echo "[test] pytest -m long"
  exec $PY -m pytest -q --durations=25 -m long
fi
echo "[test] ruff check ."
$PY -m ruff check .
echo "[test] lint-imports (scripts/lint_imports.py: the import layers of docs/layout.md)"
$PY scripts/lint_imports.py
echo "[test] make -C agreement test"
make -C agreement test
echo "[test] make -C agreement fuzz-run FUZZ_SECONDS=${FUZZ_SECONDS:-10} (per target)"
make -C agreement fuzz-run FUZZ_SECONDS="${FUZZ_SECONDS:-10}"
echo "[test] pytest -m 'not long'"
exec $PY -m pytest -q --durations=25 -m "not long"
