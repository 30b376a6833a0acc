#!/usr/bin/env bash
# test.sh - the project's whole test suite, the command the README and CI run.
# Lint, C unit tests and short fuzz runs (two targets, FUZZ_SECONDS each, 25 s by default),
# then pytest (whose summary line ends the output).
set -euo pipefail

cd "$(dirname "$0")/.."
bash scripts/setup.sh

PY=${PYTHON:-python3}
echo "[test] ruff check ."
$PY -m ruff check .
echo "[test] make -C agreement test"
make -C agreement test
echo "[test] make -C agreement fuzz-run FUZZ_SECONDS=${FUZZ_SECONDS:-25} (per target)"
make -C agreement fuzz-run FUZZ_SECONDS="${FUZZ_SECONDS:-25}"
echo "[test] pytest"
exec $PY -m pytest -q --durations=25
