#!/usr/bin/env bash
# Regenerates docs/console-key-page.png, the picture in docs/console.md:
# `sluice dev` (every service and the console, on ports of their own), a
# `sluice demo` pushing jobs through three keys, and headless Chromium's
# screenshot of one key's page a little later. Run it against a broker of
# its own:
#   scripts/with-test-broker.sh scripts/console-screenshot.sh
# Needs the debug `sluice` binary ($CARGO_TARGET_DIR/debug/sluice) and
# Chromium (scripts/dev-env.sh browser).
set -euo pipefail
cd "$(dirname "$0")/.."
SLUICE="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}/debug/sluice"
OUT="${1:-docs/console-key-page.png}"
WORK="$(mktemp -d)"
prefix="shot_$(date +%s)_"
cleanup() {
  [ -n "${demo:-}" ] && kill "$demo" 2>/dev/null || true
  [ -n "${dev:-}" ] && kill "$dev" 2>/dev/null && wait "$dev" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

SLUICE__KAFKA__TOPIC_PREFIX="$prefix" SLUICE__POSTGRES__SCHEMA_PREFIX="$prefix" \
SLUICE__ADMISSION__LISTEN=127.0.0.1:0 SLUICE__LIMIT_GRANT__LISTEN=127.0.0.1:0 \
SLUICE__RATE_WINDOW__LISTEN=127.0.0.1:0 SLUICE__REFRESH_DISPATCHER__LISTEN=127.0.0.1:0 \
SLUICE__CONSOLE__LISTEN=127.0.0.1:0 SLUICE__TELEMETRY__METRICS_LISTEN= \
SLUICE__CONSOLE__TENANTS=demo RUST_LOG=warn \
  "$SLUICE" dev >"$WORK/dev.log" 2>&1 &
dev=$!
endpoint() { awk -v name="$1" '$1 == name { sub("grpc://", "http://", $2); print $2 }' "$WORK/dev.log"; }
for _ in $(seq 1 100); do grep -q '^  console' "$WORK/dev.log" && break; sleep 0.2; done
console=$(awk '$1 == "console" { print $2 }' "$WORK/dev.log")
[ -n "$console" ] || { cat "$WORK/dev.log"; echo "sluice dev did not start" >&2; exit 1; }
export SLUICE_ADMISSION_ENDPOINT=$(endpoint admission) SLUICE_LIMIT_GRANT_ENDPOINT=$(endpoint limit-grant) \
  SLUICE_RATE_WINDOW_ENDPOINT=$(endpoint rate-window) SLUICE_REFRESH_DISPATCHER_ENDPOINT=$(endpoint refresh-dispatcher)
for _ in $(seq 1 120); do "$SLUICE" health >/dev/null 2>&1 && break; sleep 0.5; done
SLUICE__KAFKA__TOPIC_PREFIX="$prefix" \
  "$SLUICE" demo --keys 3 --limit 2 --jobs 3000 --rate 9 --min-work 300ms --max-work 1200ms --plain >"$WORK/demo.log" 2>&1 &
demo=$!
# Let the key build a minute of history; the page is sampled while it is open.
chromium_binary=/usr/lib/chromium/chromium
[ -x "$chromium_binary" ] || chromium_binary=chromium
for _ in $(seq 1 ${SHOT_ROUNDS:-6}); do
  "$chromium_binary" --headless=new --no-sandbox --disable-gpu --virtual-time-budget=100 \
    --dump-dom "${console}key?tenant=demo&key=demo-1" >/dev/null 2>&1 || true
  sleep 10
done
"$chromium_binary" --headless=new --no-sandbox --disable-gpu --hide-scrollbars \
  --window-size=1280,1350 --screenshot="$OUT" "${console}key?tenant=demo&key=demo-1" 2>/dev/null
echo "wrote $OUT"; tail -3 "$WORK/demo.log"
