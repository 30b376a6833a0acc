#!/usr/bin/env bash
# setup-go.sh - make sure a Go toolchain exists for tools/lincheck (Porcupine checker).
# Machines that already have `go` (e.g. the image's own) are left alone; a fresh Debian
# gets Debian's golang-go. Modules come later through the default module proxy, at
# `go build` time (scripts/setup.sh runs `python3 -m zz.history --build` after the Python
# package is installed), never vendored into the repo.
set -euo pipefail

say() { printf '[setup-go] %s\n' "$*"; }

if command -v go >/dev/null 2>&1; then
    say "go present: $(go version)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    say "no go and not root: run as root (sudo bash scripts/setup-go.sh)"
    exit 1
fi
# tools/lincheck/go.mod says go 1.19, which is what Debian 12's golang-go provides.
if ! apt-cache policy golang-go 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    say "apt-get update"
    apt-get update -q
fi
say "apt-get install golang-go"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends golang-go ca-certificates
say "go: $(go version)"
