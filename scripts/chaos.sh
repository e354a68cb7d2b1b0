#!/usr/bin/env bash
# `make chaos`: the four services as separate processes (two of each) on a
# fresh, dedicated tansu and PostgreSQL, and worker processes of each kind
# (Work streams, Kafka + Claim), killed with SIGKILL at random while jobs
# flow, beside the same runs without faults; one JSON line per run, and the
# last line printed is one JSON object with them all (see
# tests/src/bin/sluice-chaos.rs). CHAOS_KILLS=0: only the runs without
# faults; CHAOS_WORKERS=stream or kafka: one kind.
#
# `scripts/chaos.sh backlog` (`make bench-backlog`): the same stack and
# broker setup for the backlog benchmark instead (a million jobs waiting;
# tests/src/bin/sluice-chaos/backlog.rs), on port 19392 unless
# SLUICE_CHAOS_BROKER_PORT says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-}"
if [ "$MODE" = backlog ]; then
  PORT="${SLUICE_CHAOS_BROKER_PORT:-19392}"
else
  PORT="${SLUICE_CHAOS_BROKER_PORT:-19292}"
fi
# CHAOS_PROFILE=debug: the short run inside `make test` reuses its builds.
if [ "${CHAOS_PROFILE:-release}" = debug ]; then
  PROFILE_FLAG="" PROFILE_DIR=debug
else
  PROFILE_FLAG="--release" PROFILE_DIR=release
fi
STATE="${SLUICE_STATE_DIR:-$HOME/.cache/sluice}/chaos-broker-$PORT"
mkdir -p "$STATE"
if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  echo "port $PORT is taken; set SLUICE_CHAOS_BROKER_PORT" >&2
  exit 1
fi
SLUICE_BROKER_PORT="$PORT" SLUICE_STATE_DIR="$STATE" scripts/dev-env.sh broker
# Stop the broker and wait until it is gone, so that a next run finds its
# port free.
stop_broker() {
  local pid
  pid="$(cat "$STATE/tansu.pid" 2>/dev/null)" || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
}
trap stop_broker EXIT
echo "==> building the service binaries and the chaos runner ($PROFILE_DIR)"
if [ "$PROFILE_DIR" = debug ]; then
  # The dev build `make run` and the tests use (see the Makefile): every
  # binary of the workspace, with the test build's features and wrapper, so
  # after `make test`'s builds nothing is compiled here.
  scripts/lint-build.sh cargo build --locked --workspace --bins --examples
else
  # One invocation, so the crates they share are built once with one feature set.
  cargo build $PROFILE_FLAG --locked -p sluice-admission -p sluice-limit-grant -p sluice-rate-window \
    -p sluice-refresh-dispatcher -p sluice-e2e --bins
fi
echo "==> ${MODE:-chaos} (figures on the last line)"
SLUICE__KAFKA__BROKERS="127.0.0.1:$PORT" RUST_LOG="${RUST_LOG:-error}" \
  CHAOS_BROKER_PID="$(cat "$STATE/tansu.pid")" \
  "${CARGO_TARGET_DIR:-target}/$PROFILE_DIR/sluice-chaos" $MODE
