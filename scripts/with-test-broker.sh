#!/usr/bin/env bash
# Runs a command (the test suite) against a fresh, dedicated tansu broker,
# stopped afterwards. tansu's memory storage keeps every topic ever created
# and a long-lived broker slows down as tests add hundreds of unique topics
# per run, so tests never use the long-lived dev broker on :9092.
#   scripts/with-test-broker.sh cargo nextest run ...
# Environment: SLUICE_TEST_BROKER_PORT (default: the first free port from 19192).
set -euo pipefail
cd "$(dirname "$0")/.."

port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && exec 3>&- 3<&-
}

port="${SLUICE_TEST_BROKER_PORT:-}"
if [ -z "$port" ]; then
  port=19192
  while port_open "$port"; do port=$((port + 1)); done
elif port_open "$port"; then
  echo "port $port is taken; unset SLUICE_TEST_BROKER_PORT or pick another" >&2
  exit 1
fi
state="${SLUICE_STATE_DIR:-$HOME/.cache/sluice}/test-broker-$port"
mkdir -p "$state"
SLUICE_BROKER_PORT="$port" SLUICE_STATE_DIR="$state" scripts/dev-env.sh broker
trap 'kill "$(cat "$state/tansu.pid")" 2>/dev/null || true; rm -rf "$state"' EXIT
echo "==> tests use a fresh broker on 127.0.0.1:$port (stopped afterwards)"
export SLUICE__KAFKA__BROKERS="127.0.0.1:$port"
# Tests that need a broker of their own (frozen, restarted) start this binary.
SLUICE_TANSU="$(scripts/dev-env.sh tansu)"
export SLUICE_TANSU
"$@"
