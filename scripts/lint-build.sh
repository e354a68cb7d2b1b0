#!/usr/bin/env bash
# Runs a cargo command of the dev build with the workspace's own crates
# compiled through clippy-driver (RUSTC_WORKSPACE_WRAPPER, as `cargo clippy`
# does): each crate is compiled once and linted in that same compile, so
# `make test` needs no separate `cargo clippy` pass over the workspace and
# `make run`, the tests and the short chaos run share every artifact (the
# wrapper is part of cargo's fingerprint: use this script for all of them).
# Dependencies are compiled by plain rustc, as always.
#
#   scripts/lint-build.sh [--deny-warnings] cargo ARGS...
#
# --deny-warnings: fail if the build printed a warning (rustc's or
# clippy's, new or replayed by cargo from an earlier build), as
# `cargo clippy -- -D warnings` would. Without it warnings are shown but do
# not stop the build: a newer toolchain's new lint must not stop `make run`.
# Only for dev builds: clippy-driver turns MIR optimisations off.
set -euo pipefail
deny=0
if [ "${1:-}" = --deny-warnings ]; then
  deny=1
  shift
fi
driver="$(rustc --print sysroot)/bin/clippy-driver"
if [ ! -x "$driver" ]; then
  echo "clippy-driver not found in $(rustc --print sysroot)/bin: rustup component add clippy" >&2
  exit 1
fi
export RUSTC_WORKSPACE_WRAPPER="$driver"
if [ "$deny" = 0 ]; then
  exec "$@"
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log"
if grep -Eq '^(warning|error)(\[[^]]*\])?: ' "$log"; then
  echo "==> the build printed warnings (above); make test allows none" >&2
  exit 1
fi
