#!/usr/bin/env bash
# `make bench`: runs the benchmarks against a fresh, dedicated tansu (its
# in-memory store would otherwise carry every topic earlier runs left, which
# slows it down) on port ${SLUICE_BENCH_BROKER_PORT:-19092}, then stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${SLUICE_BENCH_BROKER_PORT:-19092}"
STATE="${SLUICE_STATE_DIR:-$HOME/.cache/sluice}/bench-broker"
mkdir -p "$STATE"
if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  echo "port $PORT is taken; set SLUICE_BENCH_BROKER_PORT" >&2
  exit 1
fi
SLUICE_BROKER_PORT="$PORT" SLUICE_STATE_DIR="$STATE" scripts/dev-env.sh broker
trap 'kill "$(cat "$STATE/tansu.pid")" 2>/dev/null || true' EXIT
cargo build --release --locked -p sluice-e2e --bin sluice-bench
echo "==> benchmarking (figures on the last line)"
SLUICE__KAFKA__BROKERS="127.0.0.1:$PORT" RUST_LOG="${RUST_LOG:-error}" BENCH_BROKER_PID="$(cat "$STATE/tansu.pid")" \
  "${CARGO_TARGET_DIR:-target}/release/sluice-bench"
