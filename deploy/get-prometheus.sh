#!/usr/bin/env bash
# A Prometheus binary for tests/test_observability.py, unless `prometheus` is already on PATH:
# Debian's `prometheus` package, downloaded (not installed) and unpacked into .tools/prometheus/,
# the binary linked at .tools/bin/prometheus. Needs apt-get and dpkg (Debian, Ubuntu); root only
# when apt's package lists are missing or stale (then it runs `apt-get update` first).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOLS="$ROOT/.tools"
BIN="$TOOLS/bin/prometheus"

if command -v prometheus >/dev/null 2>&1 || [ -x "$BIN" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
    echo "get-prometheus: no apt-get/dpkg here: install Prometheus 2.x and put \`prometheus\` on PATH" >&2
    exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
chown _apt "$tmp" 2>/dev/null || true     # as root, apt downloads as its _apt user
cd "$tmp"
echo "get-prometheus: fetching Debian's prometheus package into $TOOLS"
if ! apt-get download -qq prometheus >/dev/null 2>apt.err; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        apt-get download -qq prometheus >/dev/null
    else
        echo "get-prometheus: \`apt-get download prometheus\` failed ($(tail -n1 apt.err)): run" \
             "\`sudo apt-get update\` and retry, or \`sudo apt-get install prometheus\`" >&2
        exit 1
    fi
fi
rm -rf "$TOOLS/prometheus"
mkdir -p "$TOOLS/bin"
dpkg -x prometheus_*.deb "$TOOLS/prometheus"
touch "$TOOLS/prometheus/usr/bin/prometheus"     # newer than this script: make's target is done
ln -sfn ../prometheus/usr/bin/prometheus "$BIN"
"$BIN" --version 2>&1 | head -1
