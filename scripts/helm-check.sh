#!/usr/bin/env bash
# Checks the Helm chart offline (`make helm-check`, part of `make test`):
#
#   0. the chart's default values must NOT render: TLS and authentication
#      are on by default and need a certificate and keys the defaults cannot
#      hold, and rendering says so
#   1. helm lint --strict, with ci/production-values.yaml (cert-manager,
#      JWTs), ci/options-values.yaml (an existing TLS Secret, mutual TLS,
#      client certificates) and ci/mesh-values.yaml (plaintext gRPC)
#   2. helm template, with the same values files
#   3. validates every rendered manifest against the Kubernetes JSON schemas of
#      each version in KUBE_VERSIONS (kubernetes-validate --strict, offline).
#      Custom resources (the ServiceMonitor, monitoring.coreos.com, and the
#      cert-manager Certificate) have no schema there: they are set aside,
#      named, and checked by the chart test.
#   4. runs the chart test, tests/helm/test_chart.py
#   5. checks the Grafana dashboard against the metrics in metrics.rs
#      (tests/helm/test_dashboard.py) and deploy/ against the workspace and
#      the chart (tests/helm/test_deploy.py)
#
# Tools are installed on first use by scripts/install-helm-tools.sh into
# $SLUICE_TOOLS_DIR (default ~/.cache/sluice/tools), outside the repository.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART="$ROOT/helm/sluice"
TOOLS_DIR="${SLUICE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/tools}"
export SLUICE_TOOLS_DIR="$TOOLS_DIR"
# Chart.yaml says Kubernetes 1.27 and later (native gRPC probes); validate
# against every minor release from there to the newest kubernetes-validate
# ships schemas for (1.37 with kubernetes-validate 1.37.0).
KUBE_VERSIONS="${KUBE_VERSIONS:-1.27.0 1.28.0 1.29.0 1.30.0 1.31.0 1.32.0 1.33.0 1.34.0 1.35.0 1.36.0 1.37.0}"
# The version helm renders for (.Capabilities.KubeVersion).
RENDER_KUBE_VERSION="${RENDER_KUBE_VERSION:-1.32.0}"

step() { printf '\n==> %s\n' "$*"; }

bash "$ROOT/scripts/install-helm-tools.sh"
HELM="$TOOLS_DIR/bin/helm"
PYTHON="$TOOLS_DIR/venv/bin/python"
KUBERNETES_VALIDATE="$TOOLS_DIR/venv/bin/kubernetes-validate"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

step "helm template (default values: must fail, naming what TLS needs)"
if output="$("$HELM" template sluice "$CHART" --namespace sluice --kube-version "$RENDER_KUBE_VERSION" 2>&1)"; then
    echo "helm-check: the chart rendered with its default values; TLS and authentication are on by default and must ask for a certificate and keys" >&2
    exit 1
fi
case "$output" in
    *"tls.enabled is true (the default) but no certificate is configured"*)
        echo "ok: refused: ${output:0:120}..." ;;
    *)
        printf '%s\n' "$output"
        echo "helm-check: the default values failed for another reason than the missing TLS certificate" >&2
        exit 1 ;;
esac

# name=values file. options-values.yaml turns on the optional branches the
# other two leave off; mesh-values.yaml is the plaintext (tls.enabled=false)
# install.
VALUE_SETS=(
    "production=$CHART/ci/production-values.yaml"
    "options=$CHART/ci/options-values.yaml"
    "mesh=$CHART/ci/mesh-values.yaml"
)

for entry in "${VALUE_SETS[@]}"; do
    name="${entry%%=*}"
    values="${entry#*=}"
    values_args=()
    if [ -n "$values" ]; then values_args=(--values "$values"); fi

    step "helm lint --strict ($name values)"
    "$HELM" lint --strict --kube-version "$RENDER_KUBE_VERSION" ${values_args[@]+"${values_args[@]}"} "$CHART"

    step "helm template ($name values)"
    "$HELM" template sluice "$CHART" --namespace sluice \
        --kube-version "$RENDER_KUBE_VERSION" ${values_args[@]+"${values_args[@]}"} >"$WORK/$name.yaml"
    echo "rendered $(grep -c '^kind:' "$WORK/$name.yaml") manifests to $name.yaml"

    # Split off custom resources: kubernetes-validate has schemas for the
    # built-in API groups only, and would merely warn about the others.
    "$PYTHON" - "$WORK/$name.yaml" "$WORK/$name.builtin.yaml" <<'EOF'
import sys
import yaml

CUSTOM_GROUPS = ("monitoring.coreos.com/", "cert-manager.io/")
source, target = sys.argv[1], sys.argv[2]
with open(source) as handle:
    documents = [doc for doc in yaml.safe_load_all(handle) if doc]
builtin, custom = [], []
for doc in documents:
    (custom if doc["apiVersion"].startswith(CUSTOM_GROUPS) else builtin).append(doc)
with open(target, "w") as handle:
    yaml.safe_dump_all(builtin, handle, sort_keys=False)
for doc in custom:
    print(f"not schema-validated (custom resource, checked by tests/helm): "
          f"{doc['apiVersion']} {doc['kind']} {doc['metadata']['name']}")
EOF

    for kube_version in $KUBE_VERSIONS; do
        step "kubernetes-validate --strict -k $kube_version ($name values)"
        output="$("$KUBERNETES_VALIDATE" --strict -k "$kube_version" --quiet "$WORK/$name.builtin.yaml" 2>&1)" || {
            printf '%s\n' "$output"
            echo "helm-check: rendered manifests ($name values) do not validate against Kubernetes $kube_version" >&2
            exit 1
        }
        # A kind without a schema is only a warning there; here it is an error.
        if [ -n "$output" ]; then
            printf '%s\n' "$output"
            echo "helm-check: kubernetes-validate reported warnings ($name values, Kubernetes $kube_version)" >&2
            exit 1
        fi
        echo "ok: $(grep -c '^kind:' "$WORK/$name.builtin.yaml") manifests valid for Kubernetes $kube_version"
    done
done

step "chart test (tests/helm/test_chart.py)"
SLUICE_HELM="$HELM" "$PYTHON" "$ROOT/tests/helm/test_chart.py"

step "dashboard test (tests/helm/test_dashboard.py)"
"$PYTHON" "$ROOT/tests/helm/test_dashboard.py"

step "deploy test (tests/helm/test_deploy.py)"
"$PYTHON" "$ROOT/tests/helm/test_deploy.py"
