#!/usr/bin/env bash
# Installs what the Python worker example, the documented JSON producer examples
# and their tests need, only when it is missing, into a cache directory
# outside the repository:
#
#   $SLUICE_TOOLS_DIR/python       a Python venv with examples/python/requirements.txt
#                                  (grpcio, grpcio-tools, protobuf, confluent-kafka),
#                                  jsonschema, and what the Python SDK's tests need
#                                  (sdks/python/requirements-dev.txt: pytest, mypy,
#                                  typing stubs)
#   $SLUICE_TOOLS_DIR/bin/kcat     a wrapper that runs Debian's kcat with the
#                                  librdkafka bundled in the confluent-kafka wheel:
#                                  Debian's own librdkafka (2.0.2) cannot talk to
#                                  the tansu broker (see ../shared/TOOLING.md)
#
# SLUICE_TOOLS_DIR defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools.
# Needs python3 with the venv module, PyPI the first time, and Debian's kcat
# package (installed with apt-get when missing). When everything is present it
# changes nothing and needs no network. Progress goes to stderr; the last line
# on stdout is the venv's python.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${SLUICE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools}"
VENV="$TOOLS_DIR/python"
REQUIREMENTS="$REPO/examples/python/requirements.txt"
SDK_REQUIREMENTS="$REPO/sdks/python/requirements-dev.txt"
JSONSCHEMA="jsonschema==4.26.0"

log() { printf 'install-python-tools: %s\n' "$*" >&2; }

mkdir -p "$TOOLS_DIR/bin" "$TOOLS_DIR/kcat-lib"

# Concurrent runs (two test binaries, `make -j`) must not install at once.
exec 9>"$TOOLS_DIR/.python-lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

sudo_if_needed() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Every pinned requirement installed at its version (pip's own check, offline).
venv_ok() {
    [ -x "$VENV/bin/python" ] &&
        "$VENV/bin/python" - "$REQUIREMENTS" "$SDK_REQUIREMENTS" "$JSONSCHEMA" <<'EOF' 2>/dev/null
import importlib.metadata as metadata
import sys

lines = open(sys.argv[1]).read().splitlines() + open(sys.argv[2]).read().splitlines() + [sys.argv[3]]
for line in lines:
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, version = line.split("==")
    assert metadata.version(name) == version, (name, version)
EOF
}

install_venv() {
    log "creating a Python venv at $VENV"
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV"; then
        log "python3 cannot create a venv; on Debian/Ubuntu: apt-get install python3-venv"
        exit 1
    fi
    log "installing $(grep -hv '^#' "$REQUIREMENTS" "$SDK_REQUIREMENTS" | tr '\n' ' ')$JSONSCHEMA"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        -r "$REQUIREMENTS" -r "$SDK_REQUIREMENTS" "$JSONSCHEMA"
}

system_kcat() {
    # Not our own wrapper: the first kcat on PATH outside $TOOLS_DIR/bin.
    local candidate
    for candidate in /usr/bin/kcat /usr/local/bin/kcat /usr/bin/kafkacat; do
        if [ -x "$candidate" ]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

apt_get() {
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive \
        flock "${TMPDIR:-/tmp}/sluice-apt.lock" apt-get -o DPkg::Lock::Timeout=600 "$@"
}

install_kcat() {
    log "installing Debian's kcat package"
    # One apt-get at a time (the browser's packages install beside this in
    # `make test`; see apt_get in dev-env.sh).
    apt_get install -y -q kcat >/dev/null ||
        { apt_get update -q >/dev/null && apt_get install -y -q kcat >/dev/null; }
}

# The librdkafka inside the confluent-kafka wheel, as librdkafka.so.1.
install_kcat_lib() {
    local bundled
    bundled="$("$VENV/bin/python" - <<'EOF'
import pathlib
import confluent_kafka

libs = pathlib.Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
print(next(libs.glob("librdkafka-*.so.1")))
EOF
)"
    cp -f "$bundled" "$TOOLS_DIR/kcat-lib/librdkafka.so.1"
}

write_kcat_wrapper() {
    local real="$1"
    cat >"$TOOLS_DIR/bin/kcat.tmp" <<EOF
#!/bin/sh
# kcat with the librdkafka of the confluent-kafka wheel (written by
# scripts/install-python-tools.sh).
LD_LIBRARY_PATH="$TOOLS_DIR/kcat-lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$real" "\$@"
EOF
    chmod 0755 "$TOOLS_DIR/bin/kcat.tmp"
    mv -f "$TOOLS_DIR/bin/kcat.tmp" "$TOOLS_DIR/bin/kcat"
}

if venv_ok; then
    log "Python tools present in $VENV"
else
    install_venv
fi

if ! real_kcat="$(system_kcat)"; then
    install_kcat
    real_kcat="$(system_kcat)" || { log "kcat is still missing after apt-get install kcat"; exit 1; }
fi
if [ ! -f "$TOOLS_DIR/kcat-lib/librdkafka.so.1" ] || ! venv_ok; then
    install_kcat_lib
fi
if ! grep -qs "$real_kcat" "$TOOLS_DIR/bin/kcat"; then
    write_kcat_wrapper "$real_kcat"
fi
# Debian's kcat loads its librdkafka by soname; the wrapper points it at 2.16.
kcat_lib_ok() {
    local version
    version="$("$TOOLS_DIR/bin/kcat" -V 2>/dev/null || true)"
    [[ "$version" =~ librdkafka\ 2\.(1[6-9]|[2-9][0-9])\. ]]
}
if ! kcat_lib_ok; then
    install_kcat_lib
    kcat_lib_ok || { log "$TOOLS_DIR/bin/kcat does not run with the bundled librdkafka"; exit 1; }
fi
log "kcat present: $TOOLS_DIR/bin/kcat, with librdkafka from the confluent-kafka wheel"
echo "$VENV/bin/python"
