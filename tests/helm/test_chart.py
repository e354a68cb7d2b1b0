#!/usr/bin/env python3
"""Renders the Sluice Helm chart and asserts on what it renders.

Run by scripts/helm-check.sh with the tools venv's Python:

    SLUICE_HELM=/path/to/helm python3 tests/helm/test_chart.py [-v] [TestCase.test_name]

Needs helm v3 (SLUICE_HELM, else the one scripts/install-helm-tools.sh puts in
$SLUICE_TOOLS_DIR/bin, else `helm` on PATH) and PyYAML. Only the standard
library otherwise. Each test renders the chart with `helm template` and fails
if the property it names breaks.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tomllib
import unittest
from functools import lru_cache
from pathlib import Path


def tools_dir() -> Path:
    """Where scripts/install-helm-tools.sh installs helm and the venv."""
    configured = os.environ.get("SLUICE_TOOLS_DIR")
    if configured:
        return Path(configured)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "sluice" / "tools"


try:
    import yaml
except ModuleNotFoundError:
    # Plain `python3 tests/helm/test_chart.py`: rerun with the tools venv.
    venv = tools_dir() / "venv"
    venv_python = venv / "bin" / "python"
    if venv_python.exists() and Path(sys.prefix).resolve() != venv.resolve():
        os.execv(str(venv_python), [str(venv_python), __file__, *sys.argv[1:]])
    sys.exit("PyYAML is missing: run scripts/install-helm-tools.sh (or scripts/helm-check.sh)")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_contract import (  # noqa: E402
    DEFAULT_TOML,
    config_contract_errors,
    deep_merge,
    missing_required_fields,
    rust_config_structs,
)
# SLUICE_CHART_DIR points the test at another copy of the chart (e.g. to
# check that a deliberately broken chart fails it).
CHART = Path(os.environ.get("SLUICE_CHART_DIR") or ROOT / "helm" / "sluice").resolve()
PRODUCTION_VALUES = CHART / "ci" / "production-values.yaml"
OPTIONS_VALUES = CHART / "ci" / "options-values.yaml"
MESH_VALUES = CHART / "ci" / "mesh-values.yaml"
RELEASE = "rel"
NAMESPACE = "sluice-test"
KUBE_VERSION = "1.32.0"

# A value no legitimate rendering contains: if it shows up in a ConfigMap,
# a secret leaked.
SENTINEL = "S3ntinel-Passw0rd-7f3a9c"

COMPONENTS = {
    # component: (values key, binary, partitions key or None, default port)
    "admission": ("admission", "sluice-admission", "jobs", 50051),
    "limit-grant": ("limitGrant", "sluice-limit-grant", "limitCommands", 50052),
    "rate-window": ("rateWindow", "sluice-rate-window", "rateCommands", 50053),
    "refresh-dispatcher": ("refreshDispatcher", "sluice-refresh-dispatcher", "refreshDue", 50054),
}
SECRET_ENV = {"SLUICE__POSTGRES__URL", "SLUICE__KAFKA__SASL_USERNAME", "SLUICE__KAFKA__SASL_PASSWORD"}

# The smallest install the chart accepts with its secure defaults (TLS and
# authentication on): a TLS Secret and the identity provider's JWKS. render()
# starts from it unless a values file is given (the ci/ files are complete
# installs) or base=() asks for the chart's bare defaults.
TLS_SECRET = "sluice-tls"
JWKS_SECRET = "sluice-jwks"
ISSUER = "https://login.example.com/"
AUDIENCE = "sluice"
MINIMAL = (
    "--set", f"tls.existingSecret={TLS_SECRET}",
    "--set", f"auth.jwks.existingSecret={JWKS_SECRET}",
    "--set", f"auth.issuer={ISSUER}",
    "--set", f"auth.audience={AUDIENCE}",
)
# Where the chart mounts the Secrets (and names them in sluice.toml).
TLS_DIR = "/var/run/secrets/sluice/tls"
TOKEN_FILE = "/var/run/secrets/sluice/internal-token/token"
JWKS_FILE = "/var/run/secrets/sluice/jwks/jwks.json"
OTLP_CA_FILE = "/var/run/secrets/sluice/otlp-ca/ca.crt"
# The escape hatch for a throwaway cluster.
INSECURE = ("--set", "tls.enabled=false", "--set", "auth.enabled=false")
# The other certificate source: cert-manager.
CERT_MANAGER = ("--set", "tls.existingSecret=", "--set", "tls.certManager.enabled=true",
                "--set", "tls.certManager.issuerRef.name=internal-ca")
# Callers authenticated by client certificates alone (mutual TLS, no JWKS).
CLIENT_CERTIFICATES = (
    "--set", "auth.jwks.existingSecret=", "--set", "auth.issuer=", "--set", "auth.audience=",
    "--set", "tls.mutual=true",
    "--set-json", 'auth.clientCertificates=[{"name":"worker.payments.svc","tenants":["payments"],'
                  '"roles":["worker"]},{"name":"ops","roles":["admin","reader"]}]',
)

# Values sets every structural test runs against (on top of MINIMAL, except
# the values files).
EXISTING_SECRETS = (
    "--set", "postgres.existingSecret=pg-credentials",
    "--set", "postgres.urlKey=database-url",
    "--set", "kafka.securityProtocol=SASL_SSL",
    "--set", "kafka.sasl.existingSecret=kafka-credentials",
    "--set", "kafka.sasl.usernameKey=user",
    "--set", "kafka.sasl.passwordKey=pass",
)
VALUE_SETS = {
    "minimal": (),
    "production": ("--values", str(PRODUCTION_VALUES)),
    "existing-secrets": EXISTING_SECRETS,
}


def helm_binary() -> str:
    configured = os.environ.get("SLUICE_HELM")
    if configured:
        return configured
    cached = tools_dir() / "bin" / "helm"
    if cached.exists():
        return str(cached)
    found = shutil.which("helm")
    if not found:
        sys.exit("helm not found: run scripts/install-helm-tools.sh or set SLUICE_HELM")
    return found


HELM = helm_binary()


class RenderError(Exception):
    pass


def with_base(args: tuple[str, ...], base: tuple[str, ...] | None) -> tuple[str, ...]:
    """MINIMAL first, unless a values file (a complete install) is given or
    the caller chose the base."""
    if base is None:
        base = () if "--values" in args else MINIMAL
    return (*base, *args)


@lru_cache(maxsize=None)
def render(*args: str, base: tuple[str, ...] | None = None) -> tuple[dict, ...]:
    """`helm template` with extra arguments (on top of MINIMAL, see
    with_base); the parsed documents."""
    return tuple(doc for doc in yaml.safe_load_all(render_text(*args, base=base)) if doc)


def render_text(*args: str, base: tuple[str, ...] | None = None) -> str:
    command = [
        HELM, "template", RELEASE, str(CHART),
        "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION, *with_base(args, base),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RenderError(result.stderr.strip())
    return result.stdout


def of_kind(documents, kind: str) -> list[dict]:
    return [doc for doc in documents if doc["kind"] == kind]


def named(documents, kind: str, name: str) -> dict:
    matches = [doc for doc in of_kind(documents, kind) if doc["metadata"]["name"] == name]
    if len(matches) != 1:
        raise AssertionError(f"expected one {kind} {name}, found {len(matches)}")
    return matches[0]


def component_name(component: str) -> str:
    return f"{RELEASE}-sluice-{component}"


def pod_spec(document: dict) -> dict:
    if document["kind"] == "Pod":
        return document["spec"]
    return document["spec"]["template"]["spec"]


def workloads(documents) -> list[dict]:
    kinds = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod"}
    found = []
    for doc in documents:
        if doc["kind"] not in kinds:
            continue
        if doc["kind"] == "CronJob":
            doc = {"kind": "Job", "metadata": doc["metadata"], "spec": doc["spec"]["jobTemplate"]["spec"]}
        found.append(doc)
    return found


def all_containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def hook_annotations(document: dict) -> dict:
    return document["metadata"].get("annotations") or {}


def hook_phases(document: dict) -> set[str]:
    value = hook_annotations(document).get("helm.sh/hook", "")
    return {phase.strip() for phase in value.split(",") if phase.strip()}


def config_toml(documents, name: str = f"{RELEASE}-sluice-config") -> dict:
    return tomllib.loads(named(documents, "ConfigMap", name)["data"]["sluice.toml"])


def env_by_name(container: dict) -> dict:
    return {entry["name"]: entry for entry in container.get("env") or []}


class ChartTestCase(unittest.TestCase):
    maxDiff = None

    def assertRenderFails(self, *args: str, message: str, base: tuple[str, ...] | None = None) -> str:
        with self.assertRaises(RenderError, msg=f"rendering with {args} should fail") as caught:
            render(*args, base=base)
        self.assertIn(message, str(caught.exception))
        return str(caught.exception)


class SecretsTest(ChartTestCase):
    """No secret is ever rendered into a ConfigMap; credentials only come
    from Secrets through secretKeyRef."""

    # Every place a careless chart could accept a credential. Each attempt
    # must either be refused or leave no trace of the sentinel in a ConfigMap.
    SENTINEL_ATTEMPTS = (
        ("--set", f"postgres.url=postgres://sluice:{SENTINEL}@db:5432/sluice"),
        ("--set", f"postgres.password={SENTINEL}"),
        ("--set", f"kafka.sasl.password={SENTINEL}"),
        ("--set", f"kafka.sasl.username={SENTINEL}"),
        ("--set", f"kafka.password={SENTINEL}"),
        ("--set-string", f"kafka.properties.sasl\\.password={SENTINEL}"),
        ("--set-string", f"kafka.properties.sasl\\.jaas\\.config=user password={SENTINEL}"),
        ("--set-string", f"kafka.properties.ssl\\.key\\.password={SENTINEL}"),
        # The internal token and the TLS key come only from Secrets too.
        ("--set", f"auth.internalToken.value={SENTINEL}"),
        ("--set", f"auth.internalToken.token={SENTINEL}"),
        ("--set", f"tls.key={SENTINEL}"),
        ("--set", f"auth.jwks.document={SENTINEL}"),
    )

    def test_sentinel_secret_never_reaches_a_configmap(self):
        refused = 0
        for attempt in self.SENTINEL_ATTEMPTS:
            for base in VALUE_SETS.values():
                with self.subTest(attempt=attempt, base=base):
                    try:
                        text = render_text(*base, *attempt)
                    except RenderError:
                        refused += 1
                        continue
                    documents = [doc for doc in yaml.safe_load_all(text) if doc]
                    for config_map in of_kind(documents, "ConfigMap"):
                        self.assertNotIn(SENTINEL, yaml.safe_dump(config_map),
                                         f"{config_map['metadata']['name']} holds the secret")
                    self.assertNotIn(SENTINEL, text, "the secret was rendered somewhere")
        # The schema and the kafka.properties guard refuse every attempt.
        self.assertEqual(refused, len(self.SENTINEL_ATTEMPTS) * len(VALUE_SETS))

    def test_sasl_credentials_need_a_sasl_protocol(self):
        self.assertRenderFails("--set", "kafka.sasl.existingSecret=kafka-credentials",
                               message="kafka.securityProtocol is not SASL_SSL or SASL_PLAINTEXT")

    def test_credential_like_kafka_properties_are_refused(self):
        self.assertRenderFails(
            "--set-string", "kafka.properties.sasl\\.password=x",
            message="looks like a credential",
        )

    def test_config_file_holds_no_credential(self):
        for name, args in VALUE_SETS.items():
            with self.subTest(values=name):
                documents = render(*args)
                config_maps = of_kind(documents, "ConfigMap")
                self.assertGreaterEqual(len(config_maps), 1)
                for config_map in config_maps:
                    for key, text in config_map["data"].items():
                        self.assertNotIn("postgres://", text)
                        self.assertNotIn("postgresql://", text)
                        if key.endswith(".toml"):
                            config = tomllib.loads(text)
                            self.assertNotIn("url", config.get("postgres", {}))
                            self.assertNotIn("sasl_username", config.get("kafka", {}))
                            self.assertNotIn("sasl_password", config.get("kafka", {}))
                            for prop in config.get("kafka", {}).get("properties", {}):
                                self.assertNotRegex(prop, r"(?i)password|secret|jaas")

    def test_credentials_come_only_from_secret_key_refs(self):
        expectations = {
            "minimal": {"SLUICE__POSTGRES__URL": (f"{RELEASE}-sluice-postgres", "url")},
            "production": {
                "SLUICE__POSTGRES__URL": ("sluice-postgres", "url"),
                "SLUICE__KAFKA__SASL_USERNAME": ("sluice-kafka", "username"),
                "SLUICE__KAFKA__SASL_PASSWORD": ("sluice-kafka", "password"),
            },
            "existing-secrets": {
                "SLUICE__POSTGRES__URL": ("pg-credentials", "database-url"),
                "SLUICE__KAFKA__SASL_USERNAME": ("kafka-credentials", "user"),
                "SLUICE__KAFKA__SASL_PASSWORD": ("kafka-credentials", "pass"),
            },
        }
        for name, args in VALUE_SETS.items():
            with self.subTest(values=name):
                documents = render(*args)
                expected = expectations[name]
                for document in workloads(documents):
                    for container in all_containers(pod_spec(document)):
                        env = env_by_name(container)
                        for variable, entry in env.items():
                            if variable in SECRET_ENV or "PASSWORD" in variable or variable.endswith("_URL"):
                                self.assertNotIn("value", entry, f"{variable} has a literal value")
                                self.assertIn("secretKeyRef", entry.get("valueFrom", {}), variable)
                        self.assertFalse(container.get("envFrom"), "envFrom could pull in a ConfigMap")
                # Every service gets the PostgreSQL URL and (when configured)
                # the SASL credentials from the named Secret and keys.
                for component in COMPONENTS:
                    deployment = named(documents, "Deployment", component_name(component))
                    env = env_by_name(pod_spec(deployment)["containers"][0])
                    for variable, (secret, key) in expected.items():
                        self.assertIn(variable, env, f"{component} lacks {variable}")
                        reference = env[variable]["valueFrom"]["secretKeyRef"]
                        self.assertEqual((reference["name"], reference["key"]), (secret, key))
                    if "SLUICE__KAFKA__SASL_PASSWORD" not in expected:
                        self.assertNotIn("SLUICE__KAFKA__SASL_PASSWORD", env)

    def test_the_only_secret_rendered_is_the_internal_token(self):
        """The chart renders no Secret but the generated internal token: the
        PostgreSQL URL, Kafka credentials, TLS key and JWKS are the user's."""
        for name, args in VALUE_SETS.items():
            with self.subTest(values=name):
                secrets = of_kind(render(*args), "Secret")
                self.assertEqual([secret["metadata"]["name"] for secret in secrets],
                                 [f"{RELEASE}-sluice-internal-token"])
        self.assertEqual(of_kind(render("--set", "auth.internalToken.existingSecret=token"), "Secret"), [])
        self.assertEqual(of_kind(render(*INSECURE, base=()), "Secret"), [])

    def test_generated_token_never_reaches_a_configmap(self):
        documents = render()
        secret = named(documents, "Secret", f"{RELEASE}-sluice-internal-token")
        token = base64.b64decode(secret["data"]["internal-token"]).decode()
        for config_map in of_kind(documents, "ConfigMap"):
            self.assertNotIn(token, yaml.safe_dump(config_map), config_map["metadata"]["name"])


class SecurityContextTest(ChartTestCase):
    """Every container and init container runs as non-root with a read-only
    root filesystem, no privilege escalation, no capabilities, seccomp."""

    def effective(self, pod: dict, container: dict, field: str):
        own = (container.get("securityContext") or {}).get(field)
        return own if own is not None else (pod.get("securityContext") or {}).get(field)

    def test_every_container_is_hardened(self):
        # values: (arguments, Deployments, hook Jobs, containers in all)
        cases = {
            # 4 services + 4 migrations + topics + 4 health checks.
            **{name: (args, 4, 2, 13) for name, args in VALUE_SETS.items()},
            # No hook Jobs; the console on.
            "options": (("--values", str(OPTIONS_VALUES)), 5, 0, 9),
        }
        for name, (args, expected_deployments, expected_jobs, expected_containers) in cases.items():
            with self.subTest(values=name):
                documents = render(*args)
                seen = {"Deployment": 0, "Job": 0, "Pod": 0}
                containers_checked = 0
                for document in workloads(documents):
                    seen[document["kind"]] = seen.get(document["kind"], 0) + 1
                    spec = pod_spec(document)
                    for container in all_containers(spec):
                        where = f"{document['kind']}/{document['metadata']['name']}/{container['name']}"
                        context = container.get("securityContext") or {}
                        self.assertIs(self.effective(spec, container, "runAsNonRoot"), True, where)
                        run_as_user = self.effective(spec, container, "runAsUser")
                        self.assertIsNotNone(run_as_user, f"{where}: no numeric runAsUser")
                        self.assertNotEqual(run_as_user, 0, where)
                        self.assertIs(context.get("readOnlyRootFilesystem"), True, where)
                        self.assertIs(context.get("allowPrivilegeEscalation"), False, where)
                        self.assertNotEqual(context.get("privileged"), True, where)
                        self.assertIn("ALL", (context.get("capabilities") or {}).get("drop") or [], where)
                        self.assertFalse((context.get("capabilities") or {}).get("add"), where)
                        seccomp = context.get("seccompProfile") or (spec.get("securityContext") or {}).get("seccompProfile")
                        self.assertEqual((seccomp or {}).get("type"), "RuntimeDefault", where)
                        containers_checked += 1
                    self.assertIs(spec.get("automountServiceAccountToken"), False,
                                  f"{document['metadata']['name']} mounts an API token")
                # Deployments, the hook Jobs and the test pod were all checked.
                self.assertEqual(seen["Deployment"], expected_deployments)
                self.assertEqual(seen["Job"], expected_jobs)
                self.assertEqual(seen["Pod"], 1)
                self.assertEqual(containers_checked, expected_containers)

    def test_writable_tmp_for_read_only_root(self):
        documents = render()
        for document in workloads(documents):
            spec = pod_spec(document)
            volumes = {volume["name"]: volume for volume in spec.get("volumes") or []}
            for container in all_containers(spec):
                mounts = {mount["mountPath"]: mount["name"] for mount in container.get("volumeMounts") or []}
                self.assertIn("/tmp", mounts, container["name"])
                self.assertIn("emptyDir", volumes[mounts["/tmp"]])


class ProbesTest(ChartTestCase):
    """Every Deployment has liveness, readiness and startup probes against the
    standard gRPC health service on its gRPC port; readiness asks for the
    overall ("") status, liveness and startup for probes.liveness.grpcService.
    With TLS (the default) they are exec probes running `sluice health` over
    TLS, since the kubelet's gRPC probes cannot; without, native gRPC
    probes."""

    def health_command(self, port: int, service: str | None = None, mutual: bool = False,
                       server_name: str = f"{RELEASE}-sluice.{NAMESPACE}.svc") -> list[str]:
        command = ["/usr/local/bin/sluice", "health", "--endpoint", f"https://127.0.0.1:{port}",
                   "--tls-ca-file", f"{TLS_DIR}/ca.crt", "--tls-server-name", server_name]
        if mutual:
            command += ["--tls-cert-file", f"{TLS_DIR}/tls.crt", "--tls-key-file", f"{TLS_DIR}/tls.key"]
        if service:
            command += ["--service", service]
        return command

    def test_tls_gives_exec_probes_running_sluice_health(self):
        for name, args in VALUE_SETS.items():
            with self.subTest(values=name):
                deployments = [d for d in of_kind(render(*args), "Deployment")]
                self.assertEqual(len(deployments), 4)
                for deployment in deployments:
                    container = pod_spec(deployment)["containers"][0]
                    where = deployment["metadata"]["name"]
                    port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
                    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                        self.assertNotIn("grpc", container[probe], f"{where} {probe}: the kubelet cannot probe TLS")
                        self.assertIn("exec", container[probe], f"{where} {probe}")
                        self.assertIn("timeoutSeconds", container[probe], f"{where} {probe}")
                    # Readiness: the overall status, which reflects rebuilds.
                    self.assertEqual(container["readinessProbe"]["exec"]["command"], self.health_command(port), where)
                    for probe in ("livenessProbe", "startupProbe"):
                        self.assertEqual(container[probe]["exec"]["command"],
                                         self.health_command(port, "liveness"), f"{where} {probe}")
                    # The files the probe names are mounted.
                    mounts = {m["mountPath"] for m in container["volumeMounts"]}
                    self.assertIn(TLS_DIR, mounts, where)

    def test_exec_probes_follow_mutual_tls_server_name_and_liveness_service(self):
        documents = render("--set", "tls.mutual=true", "--set", "tls.serverName=sluice.internal",
                           "--set", "probes.liveness.grpcService=alive")
        container = pod_spec(named(documents, "Deployment", component_name("limit-grant")))["containers"][0]
        self.assertEqual(container["readinessProbe"]["exec"]["command"],
                         self.health_command(50052, mutual=True, server_name="sluice.internal"))
        self.assertEqual(container["livenessProbe"]["exec"]["command"],
                         self.health_command(50052, "alive", mutual=True, server_name="sluice.internal"))
        documents = render("--set", "probes.liveness.grpcService=")
        container = pod_spec(named(documents, "Deployment", component_name("limit-grant")))["containers"][0]
        self.assertNotIn("--service", container["livenessProbe"]["exec"]["command"])

    def test_without_tls_native_grpc_probes(self):
        for args, base in ((("--set", "tls.enabled=false"), None), (INSECURE, ()),
                           (("--values", str(MESH_VALUES)), None)):
            with self.subTest(args=args):
                deployments = of_kind(render(*args, base=base), "Deployment")
                self.assertGreaterEqual(len(deployments), 4)
                for deployment in deployments:
                    for container in pod_spec(deployment)["containers"]:
                        where = f"{deployment['metadata']['name']}/{container['name']}"
                        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
                        port = ports.get("grpc", ports.get("http"))
                        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                            self.assertIn(probe, container, f"{where} has no {probe}")
                            self.assertIn("grpc", container[probe], f"{where} {probe} is not gRPC")
                            self.assertEqual(container[probe]["grpc"]["port"], port, where)
                        # Readiness reflects partition rebuilds: the overall status.
                        self.assertIn(container["readinessProbe"]["grpc"].get("service", ""), ("",), where)
                        self.assertEqual(container["livenessProbe"]["grpc"].get("service"), "liveness", where)

    def test_probe_ports_follow_the_service_port(self):
        documents = render("--set", "rateWindow.port=6000")
        deployment = named(documents, "Deployment", component_name("rate-window"))
        container = pod_spec(deployment)["containers"][0]
        self.assertEqual(container["readinessProbe"]["exec"]["command"], self.health_command(6000))
        self.assertEqual(container["livenessProbe"]["exec"]["command"], self.health_command(6000, "liveness"))
        self.assertEqual(config_toml(documents)["rate_window"]["listen"], "0.0.0.0:6000")
        self.assertEqual(config_toml(documents)["admission"]["rate_window_endpoint"],
                         f"https://{component_name('rate-window')}.{NAMESPACE}.svc:6000")
        plaintext = render("--set", "rateWindow.port=6000", "--set", "tls.enabled=false")
        container = pod_spec(named(plaintext, "Deployment", component_name("rate-window")))["containers"][0]
        self.assertEqual(container["readinessProbe"]["grpc"]["port"], 6000)
        self.assertEqual(container["livenessProbe"]["grpc"]["port"], 6000)
        self.assertEqual(config_toml(plaintext)["admission"]["rate_window_endpoint"],
                         f"http://{component_name('rate-window')}.{NAMESPACE}.svc:6000")


class HookJobsTest(ChartTestCase):
    """Migrations and topic creation run as pre-install/pre-upgrade hooks,
    in order, after the hook-scoped ServiceAccount and ConfigMap."""

    def weight(self, document: dict) -> int:
        return int(hook_annotations(document).get("helm.sh/hook-weight", "0"))

    def test_migration_job_is_a_pre_install_pre_upgrade_hook(self):
        for name, args in VALUE_SETS.items():
            with self.subTest(values=name):
                documents = render(*args)
                job = named(documents, "Job", f"{RELEASE}-sluice-migrate")
                self.assertTrue({"pre-install", "pre-upgrade"} <= hook_phases(job), hook_phases(job))
                policy = hook_annotations(job).get("helm.sh/hook-delete-policy", "")
                self.assertIn("before-hook-creation", policy)
                spec = pod_spec(job)
                self.assertEqual(spec["restartPolicy"], "Never")
                # Every service's `migrate`, one after the other.
                commands = [(c["command"][0], c["args"][-1]) for c in all_containers(spec)]
                self.assertEqual(commands, [(f"/usr/local/bin/{binary}", "migrate")
                                            for _, binary, _, _ in COMPONENTS.values()])
                self.assertEqual(len(spec["containers"]), 1, "init containers run in order; one main")
                self.assertFalse(config_toml(documents)["postgres"]["run_migrations"])

    def test_topic_job_is_a_hook_after_migrations(self):
        for name, args in VALUE_SETS.items():
            with self.subTest(values=name):
                documents = render(*args)
                migrate = named(documents, "Job", f"{RELEASE}-sluice-migrate")
                topics = named(documents, "Job", f"{RELEASE}-sluice-topics")
                self.assertTrue({"pre-install", "pre-upgrade"} <= hook_phases(topics), hook_phases(topics))
                self.assertIn("before-hook-creation", hook_annotations(topics).get("helm.sh/hook-delete-policy", ""))
                self.assertLess(self.weight(migrate), self.weight(topics))
                container = pod_spec(topics)["containers"][0]
                self.assertEqual(container["command"], ["/usr/local/bin/sluice"])
                self.assertEqual(container["args"][:2], ["topics", "ensure"])
                self.assertFalse(config_toml(documents)["kafka"]["create_topics"])

    def test_hook_jobs_only_use_hook_resources(self):
        documents = render()
        jobs = of_kind(documents, "Job")
        self.assertEqual(len(jobs), 2)
        for job in jobs:
            spec = pod_spec(job)
            account = named(documents, "ServiceAccount", spec["serviceAccountName"])
            config_names = [v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v]
            self.assertEqual(len(config_names), 1)
            config_map = named(documents, "ConfigMap", config_names[0])
            # Pre-install hooks run before the release's resources exist, so
            # everything a Job uses must be a hook itself, created before it.
            for dependency in (account, config_map):
                self.assertTrue({"pre-install", "pre-upgrade"} <= hook_phases(dependency),
                                dependency["metadata"]["name"])
                self.assertLess(self.weight(dependency), self.weight(job))
            # Same configuration as the services.
            self.assertEqual(config_map["data"], named(documents, "ConfigMap", f"{RELEASE}-sluice-config")["data"])

    def test_jobs_get_only_the_credentials_they_use(self):
        documents = render("--values", str(PRODUCTION_VALUES))
        migrate = named(documents, "Job", f"{RELEASE}-sluice-migrate")
        topics = named(documents, "Job", f"{RELEASE}-sluice-topics")
        for container in all_containers(pod_spec(migrate)):
            self.assertEqual(set(env_by_name(container)) & SECRET_ENV, {"SLUICE__POSTGRES__URL"})
        self.assertEqual(set(env_by_name(pod_spec(topics)["containers"][0])) & SECRET_ENV,
                         {"SLUICE__KAFKA__SASL_USERNAME", "SLUICE__KAFKA__SASL_PASSWORD"})

    def test_disabling_the_jobs_hands_the_work_to_the_services(self):
        documents = render("--set", "migrations.enabled=false", "--set", "topicsJob.enabled=false")
        self.assertEqual(of_kind(documents, "Job"), [])
        config = config_toml(documents)
        self.assertTrue(config["postgres"]["run_migrations"])
        self.assertTrue(config["kafka"]["create_topics"])


class ReplicaCapTest(ChartTestCase):
    """Partition-owning services cannot have more replicas than partitions."""

    def test_replicas_above_partition_count_fail(self):
        for component, (values_key, _, partitions_key, _) in COMPONENTS.items():
            if partitions_key is None:
                continue
            with self.subTest(component=component):
                self.assertRenderFails(
                    "--set", f"kafka.partitions.{partitions_key}=4",
                    "--set", f"{values_key}.replicas=5",
                    message=f"{values_key}.replicas (5) exceeds kafka.partitions.{partitions_key} (4)",
                )
                documents = render("--set", f"kafka.partitions.{partitions_key}=4",
                                   "--set", f"{values_key}.replicas=4")
                self.assertEqual(named(documents, "Deployment", component_name(component))["spec"]["replicas"], 4)

    def test_limit_grant_default_partitions(self):
        self.assertRenderFails("--set", "limitGrant.replicas=13",
                               message="exceeds kafka.partitions.limitCommands (12)")

    def test_autoscaling_max_above_partition_count_fails(self):
        self.assertRenderFails(
            "--set", "rateWindow.autoscaling.enabled=true",
            "--set", "rateWindow.autoscaling.maxReplicas=13",
            message="rateWindow.autoscaling.maxReplicas (13) exceeds kafka.partitions.rateCommands (12)",
        )

    def test_admission_is_capped_by_its_job_partitions(self):
        # Admission owns the job partitions (sluice.jobs) since the hot-path
        # rebuild, so it is capped like the other owners.
        self.assertRenderFails("--set", "admission.replicas=13",
                               message="admission.replicas (13) exceeds kafka.partitions.jobs (12)")
        documents = render("--set", "admission.replicas=12")
        self.assertEqual(named(documents, "Deployment", component_name("admission"))["spec"]["replicas"], 12)


class ScalingTest(ChartTestCase):
    def test_production_values(self):
        documents = render("--values", str(PRODUCTION_VALUES))
        config = config_toml(documents)
        for partitions in config["kafka"]["partitions"].values():
            self.assertGreaterEqual(partitions, 3)
        hpas = of_kind(documents, "HorizontalPodAutoscaler")
        self.assertEqual([hpa["spec"]["scaleTargetRef"]["name"] for hpa in hpas], [component_name("admission")])
        self.assertGreaterEqual(hpas[0]["spec"]["minReplicas"], 3)
        for component in COMPONENTS:
            deployment = named(documents, "Deployment", component_name(component))
            if component == "admission":
                # The HPA owns the replica count.
                self.assertNotIn("replicas", deployment["spec"])
            else:
                self.assertEqual(deployment["spec"]["replicas"], 3)
        self.assertEqual(len(of_kind(documents, "PodDisruptionBudget")), 4)
        self.assertEqual(len(of_kind(documents, "ServiceMonitor")), 1)

    def test_owner_autoscaling_is_off_by_default(self):
        documents = render()
        self.assertEqual(of_kind(documents, "HorizontalPodAutoscaler"), [])
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        for values_key, _, partitions_key, _ in COMPONENTS.values():
            self.assertFalse(values[values_key]["autoscaling"]["enabled"], values_key)

    def test_pdbs_select_their_deployment(self):
        documents = render("--values", str(PRODUCTION_VALUES))
        for component in COMPONENTS:
            pdb = named(documents, "PodDisruptionBudget", component_name(component))
            labels = pod_spec_labels(named(documents, "Deployment", component_name(component)))
            self.assertTrue(selects(pdb["spec"]["selector"]["matchLabels"], labels), component)

    def test_topology_spread_selects_own_pods(self):
        documents = render()
        for component in COMPONENTS:
            deployment = named(documents, "Deployment", component_name(component))
            constraints = pod_spec(deployment)["topologySpreadConstraints"]
            self.assertTrue(constraints)
            for constraint in constraints:
                self.assertTrue(selects(constraint["labelSelector"]["matchLabels"], pod_spec_labels(deployment)))


def pod_spec_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


class WiringTest(ChartTestCase):
    """Services, endpoints, configuration and the helm test pod agree."""

    def test_services_select_their_deployment(self):
        for name, args in VALUE_SETS.items():
            with self.subTest(values=name):
                documents = render(*args)
                for component, (_, binary, _, port) in COMPONENTS.items():
                    service = named(documents, "Service", component_name(component))
                    deployment = named(documents, "Deployment", component_name(component))
                    self.assertTrue(selects(service["spec"]["selector"], pod_spec_labels(deployment)))
                    # No other Deployment's pods behind this Service.
                    for other in COMPONENTS:
                        if other != component:
                            other_labels = pod_spec_labels(named(documents, "Deployment", component_name(other)))
                            self.assertFalse(selects(service["spec"]["selector"], other_labels))
                    grpc = [p for p in service["spec"]["ports"] if p["name"] == "grpc"][0]
                    self.assertEqual(grpc["port"], port)
                    container = pod_spec(deployment)["containers"][0]
                    self.assertEqual(container["command"], [f"/usr/local/bin/{binary}"])
                    self.assertEqual(container["args"][-1], "run")

    def test_config_file_matches_values(self):
        documents = render("--values", str(PRODUCTION_VALUES))
        values = yaml.safe_load(PRODUCTION_VALUES.read_text())
        config = config_toml(documents)
        self.assertEqual(config["kafka"]["brokers"], values["kafka"]["brokers"])
        self.assertEqual(config["kafka"]["partitions"]["limit_commands"], values["kafka"]["partitions"]["limitCommands"])
        self.assertEqual(config["kafka"]["partitions"]["rate_commands"], values["kafka"]["partitions"]["rateCommands"])
        self.assertEqual(config["kafka"]["partitions"]["refresh_due"], values["kafka"]["partitions"]["refreshDue"])
        self.assertEqual(config["kafka"]["properties"]["security.protocol"], "SASL_SSL")
        self.assertEqual(config["kafka"]["properties"]["sasl.mechanisms"], "SCRAM-SHA-512")
        self.assertEqual(config["telemetry"]["otlp_endpoint"], values["telemetry"]["otlpEndpoint"])
        self.assertIsInstance(config["telemetry"]["sampling_ratio"], float)
        self.assertEqual(config["telemetry"]["sampling_ratio"], values["telemetry"]["samplingRatio"])
        self.assertEqual(set(config["task_groups"]), set(values["taskGroups"]))
        self.assertEqual(config["task_groups"]["emails"]["caps"], [{"key": "smtp", "max": 50, "scope": "global"}])
        self.assertEqual(config["task_groups"]["emails"]["run_timeout"], "15m")
        # Admission reaches the other services through their Services.
        for key, component in (("limit_grant_endpoint", "limit-grant"), ("rate_window_endpoint", "rate-window")):
            service = named(documents, "Service", component_name(component))
            port = [p for p in service["spec"]["ports"] if p["name"] == "grpc"][0]["port"]
            self.assertEqual(config["admission"][key], f"https://{service['metadata']['name']}.{NAMESPACE}.svc:{port}")

    def test_default_sampling_ratio_is_a_toml_float(self):
        config = config_toml(render())
        self.assertIsInstance(config["telemetry"]["sampling_ratio"], float)
        self.assertEqual(config["telemetry"]["sampling_ratio"], 1.0)

    def test_partition_owners_advertise_their_pod_ip(self):
        documents = render()
        config = config_toml(documents)
        for component, (values_key, _, partitions_key, port) in COMPONENTS.items():
            if partitions_key is None:
                continue
            section = config[component.replace("-", "_")]
            self.assertEqual(section["advertised_endpoint"], "")
            self.assertEqual(section["listen"], f"0.0.0.0:{port}")
            env = env_by_name(pod_spec(named(documents, "Deployment", component_name(component)))["containers"][0])
            self.assertEqual(env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP")

    def test_config_change_rolls_the_pods(self):
        def checksums(*args):
            return {
                d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for d in of_kind(render(*args), "Deployment")
            }
        before = checksums()
        after = checksums("--set", "telemetry.samplingRatio=0.5")
        self.assertEqual(set(before), set(after))
        for name in before:
            self.assertNotEqual(before[name], after[name], name)
        self.assertEqual(before, checksums(), "the checksum must be stable")

    def test_helm_test_pod_checks_every_service(self):
        for args, scheme, base in ((("--set", "tls.mutual=true"), "https", None), (INSECURE, "http", ())):
            with self.subTest(args=args):
                documents = render(*args, base=base)
                pods = of_kind(documents, "Pod")
                self.assertEqual(len(pods), 1)
                pod = pods[0]
                self.assertIn("test", hook_phases(pod))
                self.assertEqual(pod["spec"]["restartPolicy"], "Never")
                endpoints = set()
                for container in pod["spec"]["containers"]:
                    self.assertEqual(container["command"], ["/usr/local/bin/sluice"])
                    self.assertEqual(container["args"][:2], ["health", "--endpoint"])
                    endpoints.add(container["args"][2])
                    mounts = {m["name"]: m for m in container["volumeMounts"]}
                    if scheme == "https":
                        # It checks the certificate like the services do, and
                        # presents the release's own under mutual TLS.
                        self.assertEqual(container["args"][3:], [
                            "--tls-ca-file", f"{TLS_DIR}/ca.crt",
                            "--tls-server-name", f"{RELEASE}-sluice.{NAMESPACE}.svc",
                            "--tls-cert-file", f"{TLS_DIR}/tls.crt", "--tls-key-file", f"{TLS_DIR}/tls.key"])
                        self.assertEqual(mounts["tls"]["mountPath"], TLS_DIR)
                        self.assertTrue(mounts["tls"]["readOnly"])
                    else:
                        self.assertEqual(container["args"][3:], [])
                        self.assertNotIn("tls", mounts)
                    # Health needs no credentials: no token in the test pod.
                    self.assertNotIn("internal-token", mounts)
                if scheme == "https":
                    volume = {v["name"]: v for v in pod["spec"]["volumes"]}["tls"]
                    self.assertEqual(volume["secret"]["secretName"], TLS_SECRET)
                expected = set()
                for component in COMPONENTS:
                    service = named(documents, "Service", component_name(component))
                    port = [p for p in service["spec"]["ports"] if p["name"] == "grpc"][0]["port"]
                    expected.add(f"{scheme}://{service['metadata']['name']}.{NAMESPACE}.svc:{port}")
                self.assertEqual(endpoints, expected)

    def test_service_monitor_scrapes_the_metrics_ports(self):
        documents = render("--values", str(PRODUCTION_VALUES))
        monitor = of_kind(documents, "ServiceMonitor")[0]
        self.assertEqual(monitor["apiVersion"], "monitoring.coreos.com/v1")
        selector = monitor["spec"]["selector"]["matchLabels"]
        endpoint_ports = {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
        selected = [s for s in of_kind(documents, "Service") if selects(selector, s["metadata"]["labels"])]
        self.assertEqual(len(selected), 4)
        for service in selected:
            names = {port["name"] for port in service["spec"]["ports"]}
            self.assertTrue(endpoint_ports <= names, service["metadata"]["name"])
        for deployment in of_kind(documents, "Deployment"):
            ports = {p["name"]: p["containerPort"] for p in pod_spec(deployment)["containers"][0]["ports"]}
            self.assertEqual(ports.get("metrics"), 9090)
        self.assertEqual(monitor["spec"]["namespaceSelector"]["matchNames"], [NAMESPACE])

    def test_service_monitor_needs_metrics(self):
        self.assertRenderFails("--set", "metrics.serviceMonitor.enabled=true",
                               message="metrics.serviceMonitor.enabled needs metrics.enabled")

    def test_network_policy_admits_the_release_and_the_test_pod(self):
        documents = render("--values", str(PRODUCTION_VALUES))
        policies = of_kind(documents, "NetworkPolicy")
        self.assertEqual(len(policies), 4)
        test_pod_labels = of_kind(documents, "Pod")[0]["metadata"]["labels"]
        for policy in policies:
            peers = policy["spec"]["ingress"][0]["from"]
            release_peer = [p for p in peers if "podSelector" in p and "namespaceSelector" not in p][0]
            self.assertTrue(selects(release_peer["podSelector"]["matchLabels"], test_pod_labels))
            for component in COMPONENTS:
                labels = pod_spec_labels(named(documents, "Deployment", component_name(component)))
                self.assertTrue(selects(release_peer["podSelector"]["matchLabels"], labels))


# ---------------------------------------------------------------------------
# The configuration file against the Rust code that reads it
# (config_contract.py), and the dashboard.

DASHBOARD = ROOT / "deploy" / "grafana" / "sluice-dashboard.json"
CHART_DASHBOARD = CHART / "dashboards" / "sluice.json"


class ConfigContractTest(ChartTestCase):
    """The rendered sluice.toml is one the services accept: config.rs structs
    are `deny_unknown_fields`, so a key the code does not have would stop
    every pod at startup."""

    ALL_VALUE_SETS = {**VALUE_SETS, "options": ("--values", str(OPTIONS_VALUES)),
                      "mesh": ("--values", str(MESH_VALUES)),
                      "metrics": ("--set", "metrics.enabled=true",
                                  "--set-json", 'telemetry.keyMetrics.patterns=["acme/*","*/smtp"]'),
                      "cert-manager": CERT_MANAGER,
                      "client-certificates": CLIENT_CERTIFICATES,
                      "insecure": ("--set", "tls.enabled=false", "--set", "auth.enabled=false")}

    def test_the_parser_reads_config_rs(self):
        structs = rust_config_structs()
        for name in ("SluiceConfig", "PostgresConfig", "KafkaConfig", "TelemetryConfig",
                     "AdmissionConfig", "OwnerServiceConfig", "TaskGroupConfig", "CapConfig",
                     "TlsConfig", "AuthConfig", "ClientCertificatePrincipal", "ProcessConfig"):
            self.assertIn(name, structs)
        self.assertEqual(structs["AuthConfig"]["client_certificates"][0], "Vec<ClientCertificatePrincipal>")
        # A stray key inside an [[auth.client_certificates]] table is caught.
        self.assertTrue(config_contract_errors({"auth": {"client_certificates": [{"name": "w", "role": ["worker"]}]}}))
        self.assertTrue(config_contract_errors({"auth": {"client_certificates": {"name": "w"}}}))
        self.assertEqual(structs["SluiceConfig"]["task_groups"][0], "BTreeMap<String, TaskGroupConfig>")
        self.assertTrue(structs["OwnerServiceConfig"]["ticket_grace"][1], "serde default not seen")
        # The embedded defaults satisfy the same contract.
        defaults = tomllib.loads(DEFAULT_TOML.read_text())
        self.assertEqual(config_contract_errors(defaults), [])
        self.assertEqual(missing_required_fields(defaults), [])
        # And the check does catch a stray key.
        self.assertTrue(config_contract_errors({"telemetry": {"metrics_port": 9090}}))

    def test_rendered_config_has_only_keys_the_code_reads(self):
        for name, args in self.ALL_VALUE_SETS.items():
            with self.subTest(values=name):
                documents = render(*args)
                for config_map in of_kind(documents, "ConfigMap"):
                    if "sluice.toml" not in config_map.get("data", {}):
                        continue
                    config = tomllib.loads(config_map["data"]["sluice.toml"])
                    self.assertEqual(config_contract_errors(config), [], config_map["metadata"]["name"])
                    layered = deep_merge(tomllib.loads(DEFAULT_TOML.read_text()), config)
                    self.assertEqual(missing_required_fields(layered), [])

    def test_values_an_earlier_chart_read_are_accepted_and_named(self):
        """Values chart 0.2.0 had (the grants topic) still render, are left
        out of sluice.toml, and the release notes name them."""
        documents = render("--set", "kafka.partitions.grants=12", "--set", "topics.grants=sluice.grants")
        config_maps = [c for c in of_kind(documents, "ConfigMap") if "sluice.toml" in c.get("data", {})]
        self.assertTrue(config_maps)
        for config_map in config_maps:
            self.assertNotIn("grants", config_map["data"]["sluice.toml"])
        notes = (CHART / "templates" / "NOTES.txt").read_text()
        for key in ("kafka.partitions.grants", "topics.grants"):
            self.assertIn(f"WARNING: {key} is ignored", notes)

    def test_resend_intervals_are_sluices_defaults_unless_set(self):
        """admission.resend_waiting_after and claim_timeout are left unset by
        default, so Sluice derives them from the session timeout (12 s and
        30 s) as it does outside the chart; the chart once pinned the old
        30 s and 60 s, so a lost acquire cost a chart user 30 s."""
        admission = config_toml(render())["admission"]
        self.assertNotIn("resend_waiting_after", admission)
        self.assertNotIn("claim_timeout", admission)
        admission = config_toml(render(
            "--set", "admission.config.resendWaitingAfter=20s",
            "--set", "admission.config.claimTimeout=45s",
        ))["admission"]
        self.assertEqual(admission["resend_waiting_after"], "20s")
        self.assertEqual(admission["claim_timeout"], "45s")
        with self.assertRaises(RenderError):
            render("--set", "admission.config.claimTimeout=0s")

    def test_payload_limit_fits_the_message_size(self):
        """The services refuse to start when admission.max_payload_bytes plus
        the admitted message's envelope does not fit in
        kafka.max_message_bytes (SluiceConfig::admitted_envelope_bytes in
        config.rs: ids, task group, key, trace headers, record overhead);
        0 means the largest that fits."""
        for name, args in self.ALL_VALUE_SETS.items():
            with self.subTest(values=name):
                for config_map in of_kind(render(*args), "ConfigMap"):
                    if "sluice.toml" not in config_map.get("data", {}):
                        continue
                    config = tomllib.loads(config_map["data"]["sluice.toml"])
                    payload = config["admission"]["max_payload_bytes"]
                    envelope = 2 * (200 + 16) + 200 + config["admission"]["max_key_bytes"] + 512 + 256 + 512
                    self.assertTrue(
                        payload == 0 or payload + envelope <= config["kafka"]["max_message_bytes"],
                        f"{payload} + {envelope} > {config['kafka']['max_message_bytes']}",
                    )

    # Fields the chart leaves to default.toml on purpose: credentials come
    # from Secrets through the environment; OwnerServiceConfig's per-service
    # extras only mean something in one section each.
    NOT_RENDERED_ON_PURPOSE = {
        "postgres.url", "kafka.sasl_username", "kafka.sasl_password",
        "limit_grant.granted_retention", "rate_window.ticket_grace",
    }

    def test_report_fields_the_chart_does_not_set(self):
        """Not a failure: default.toml supplies them. Listed so a new
        setting in config.rs gets a value in the chart when it should."""
        config = config_toml(render())
        structs = rust_config_structs()
        unset = []
        for section, (section_type, _) in structs["SluiceConfig"].items():
            if section_type not in structs or section not in config:
                continue
            for field in structs[section_type]:
                name = f"{section}.{field}"
                if field not in config[section] and name not in self.NOT_RENDERED_ON_PURPOSE:
                    unset.append(name)
        if unset:
            print(f"\nnote: config.rs fields the chart leaves to default.toml: {', '.join(unset)}",
                  file=sys.stderr)
        self.assertNotIn("telemetry.metrics_listen", unset)

    def test_metrics_endpoint_follows_the_metrics_values(self):
        disabled = config_toml(render())
        self.assertEqual(disabled["telemetry"]["metrics_listen"], "")
        documents = render("--values", str(OPTIONS_VALUES))
        config = config_toml(documents, f"{RELEASE}-queue-config")
        self.assertEqual(config["telemetry"]["metrics_listen"], "0.0.0.0:9464")
        for deployment in of_kind(documents, "Deployment"):
            ports = {p["name"]: p["containerPort"] for p in pod_spec(deployment)["containers"][0]["ports"]}
            self.assertEqual(ports["metrics"], 9464)

    def test_key_metrics_selection_is_rendered(self):
        config = config_toml(render("--set", "telemetry.keyMetrics.topN=5",
                                    "--set-json", 'telemetry.keyMetrics.patterns=["acme/payments-*"]'))
        self.assertEqual(config["telemetry"]["key_metrics_top_n"], 5)
        self.assertEqual(config["telemetry"]["key_metrics_patterns"], ["acme/payments-*"])
        self.assertEqual(config_toml(render())["telemetry"]["key_metrics_patterns"], [])

    def test_rate_window_granted_retention_is_rendered(self):
        config = config_toml(render("--set", "rateWindow.config.grantedRetention=10m"))
        self.assertEqual(config["rate_window"]["granted_retention"], "10m")

    def test_startup_validation_rules_fail_the_render(self):
        """Rules SluiceConfig::validate() applies at startup, checked at render
        time so a bad upgrade fails before any pod crash-loops."""
        self.assertRenderFails("--set", "admission.config.standBehindInterval=16s",
                               message="must be at most half of limitGrant.config.ticketGrace")
        self.assertRenderFails("--set", "limitGrant.config.ticketGrace=1m",
                               "--set", "admission.config.standBehindInterval=31s",
                               message="must be at most half of limitGrant.config.ticketGrace")
        render("--set", "limitGrant.config.ticketGrace=1m", "--set", "admission.config.standBehindInterval=30s")
        render("--set", "admission.config.standBehindInterval=15000ms")
        self.assertRenderFails("--set", "admission.config.sweepInterval=0s",
                               message="admission.config.sweepInterval must be greater than 0")
        self.assertRenderFails("--set", "taskGroups.default.lease=50ms",
                               message="taskGroups.default.lease (50ms) must be at least 100ms")
        render("--set", "taskGroups.default.lease=1.5s")
        render("--set", "taskGroups.default.lease=1h 30min")


class DashboardChartTest(ChartTestCase):
    """The optional Grafana dashboard ConfigMap."""

    def dashboard_config_maps(self, documents) -> list[dict]:
        return [doc for doc in of_kind(documents, "ConfigMap")
                if "sluice.json" in (doc.get("data") or {})]

    def test_off_by_default(self):
        self.assertEqual(self.dashboard_config_maps(render()), [])
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        self.assertFalse(values["grafana"]["dashboard"]["enabled"])

    def test_the_chart_ships_the_deploy_dashboard(self):
        self.assertEqual(CHART_DASHBOARD.read_bytes(), DASHBOARD.read_bytes(),
                         f"{CHART_DASHBOARD} differs from {DASHBOARD}; copy the deploy/ one over it")
        documents = render("--set", "grafana.dashboard.enabled=true",
                           "--set", "grafana.dashboard.namespace=monitoring",
                           "--set", "grafana.dashboard.annotations.grafana_folder=Sluice")
        config_maps = self.dashboard_config_maps(documents)
        self.assertEqual(len(config_maps), 1)
        config_map = config_maps[0]
        self.assertEqual(config_map["metadata"]["labels"].get("grafana_dashboard"), "1")
        self.assertEqual(config_map["metadata"]["namespace"], "monitoring")
        self.assertEqual(config_map["metadata"]["annotations"], {"grafana_folder": "Sluice"})
        self.assertEqual(json.loads(config_map["data"]["sluice.json"]), json.loads(DASHBOARD.read_text()))

    def test_custom_sidecar_label(self):
        documents = render("--set", "grafana.dashboard.enabled=true",
                           "--set", "grafana.dashboard.labels.grafana_dashboard=null",
                           "--set", "grafana.dashboard.labels.dashboards=sluice")
        labels = self.dashboard_config_maps(documents)[0]["metadata"]["labels"]
        self.assertEqual(labels.get("dashboards"), "sluice")
        self.assertNotIn("grafana_dashboard", labels)

    def test_service_monitor_keeps_the_service_label(self):
        monitor = of_kind(render("--values", str(PRODUCTION_VALUES)), "ServiceMonitor")[0]
        for endpoint in monitor["spec"]["endpoints"]:
            self.assertIs(endpoint.get("honorLabels"), True)


class NamesTest(ChartTestCase):
    def test_long_names_stay_within_dns_label_limits(self):
        long_name = "a" * 63
        documents = render("--set", f"fullnameOverride={long_name}")
        names = [(doc["kind"], doc["metadata"]["name"]) for doc in documents]
        self.assertEqual(len(names), len(set(names)), "two resources share a name")
        for kind, name in names:
            # Services, Jobs (job-name label), pods and labels: DNS labels.
            self.assertLessEqual(len(name), 63, f"{kind} {name}")
            self.assertRegex(name, r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", f"{kind} {name}")


class SchemaTest(ChartTestCase):
    """values.schema.json refuses malformed values."""

    def test_invalid_values_are_refused(self):
        cases = (
            ("--set", "telemetry.samplingRatio=1.5"),
            ("--set", "kafka.partitions.limitCommands=0"),
            ("--set", "admission.port=70000"),
            ("--set", "telemetry.logFormat=xml"),
            ("--set", "taskGroups.default.lease=soon"),
            ("--set", "taskGroups.bad/name.lease=30s"),
            ("--set", "postgres.maxConnections=1"),
            ("--set", "limitGrant.replicaz=2"),
            ("--set", "image.pullPolicy=Sometimes"),
            ("--set", "kafka.securityProtocol=TLS"),
            # Neither http:// nor https://.
            ("--set", "telemetry.otlpEndpoint=otlp.example.com:4317"),
            ("--set", "telemetry.otlpCa.existingSecret=Not_A_Secret"),
            # Units humantime does not know.
            ("--set", "admission.config.claimTimeout=10parsecs"),
            ("--set", "rateWindow.config.grantedRetention=5 minuten"),
            ("--set", "telemetry.keyMetrics.topN=-1"),
            ("--set", "grafana.dashboard.namespace=Not_A_Namespace"),
        )
        for case in cases:
            with self.subTest(case=case):
                with self.assertRaises(RenderError):
                    render(*case)

    def test_every_value_is_documented(self):
        """Every key in values.yaml has a comment line right above it (or
        belongs to a documented block of Kubernetes passthrough objects)."""
        lines = (CHART / "values.yaml").read_text().splitlines()
        undocumented = []
        passthrough_depth = None
        for index, line in enumerate(lines):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            indent = len(line) - len(line.lstrip())
            if passthrough_depth is not None:
                if indent > passthrough_depth:
                    continue
                passthrough_depth = None
            if stripped.startswith("- ") or ":" not in stripped:
                continue
            comment = []
            above = index - 1
            while above >= 0 and lines[above].strip().startswith("#"):
                comment.insert(0, lines[above].strip())
                above -= 1
            opens_block = stripped.endswith(":")
            if not opens_block and not comment:
                undocumented.append(f"line {index + 1}: {stripped}")
            if opens_block and comment and comment[0].startswith("# --"):
                # A documented passthrough object (resources, strategy, ...).
                passthrough_depth = indent
        self.assertEqual(undocumented, [])


class ConsoleTest(ChartTestCase):
    """The web console: off by default; on, a Deployment, a Service and an
    optional Ingress, with the services' probes and security context, reading
    the services through their Services, with no PostgreSQL credentials."""

    ON = ("--set", "console.enabled=true")

    def test_off_by_default(self):
        for name, args in VALUE_SETS.items():
            with self.subTest(values=name):
                documents = render(*args)
                names = {(doc["kind"], doc["metadata"]["name"]) for doc in documents}
                for kind in ("Deployment", "Service", "Ingress"):
                    self.assertNotIn((kind, component_name("console")), names)
                self.assertNotIn("console", config_toml(documents))

    def test_same_probes_and_security_context_as_the_services(self):
        # Without TLS the console's probes are the services' (native gRPC).
        documents = render(*self.ON, "--set", "tls.enabled=false")
        console = named(documents, "Deployment", component_name("console"))
        for component in COMPONENTS:
            with self.subTest(component=component):
                service = named(documents, "Deployment", component_name(component))
                container = pod_spec(console)["containers"][0]
                service_container = pod_spec(service)["containers"][0]
                self.assertEqual(pod_spec(console)["securityContext"], pod_spec(service)["securityContext"])
                self.assertEqual(container["securityContext"], service_container["securityContext"])
                self.assertEqual(pod_spec(console)["automountServiceAccountToken"], False)
                console_port = {port["name"]: port["containerPort"] for port in container["ports"]}["http"]
                service_port = {port["name"]: port["containerPort"] for port in service_container["ports"]}["grpc"]
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    expected = json.loads(json.dumps(service_container[probe]).replace(
                        f'"port": {service_port}', f'"port": {console_port}'))
                    self.assertEqual(container[probe], expected, probe)
                self.assertEqual(container["volumeMounts"], service_container["volumeMounts"])
        container = pod_spec(console)["containers"][0]
        self.assertEqual(container["command"], ["/usr/local/bin/sluice-console"])
        # With TLS the services get exec probes; the console serves plain
        # HTTP and keeps native gRPC ones, but mounts the same Secrets (the
        # CA and certificate to call the services, the internal token).
        with_tls = render(*self.ON, "--set", "tls.mutual=true")
        console_tls = pod_spec(named(with_tls, "Deployment", component_name("console")))["containers"][0]
        service_tls = pod_spec(named(with_tls, "Deployment", component_name("admission")))["containers"][0]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            self.assertEqual(console_tls[probe], container[probe], probe)
        self.assertEqual(console_tls["volumeMounts"], service_tls["volumeMounts"])
        self.assertEqual(pod_spec(named(with_tls, "Deployment", component_name("console")))["volumes"][1:],
                         pod_spec(named(with_tls, "Deployment", component_name("admission")))["volumes"][1:])
        self.assertEqual(container["args"][-1], "run")
        self.assertNotIn("SLUICE__POSTGRES__URL", env_by_name(container), "the console owns no tables")
        with_sasl = render(*self.ON, *EXISTING_SECRETS)
        env = env_by_name(pod_spec(named(with_sasl, "Deployment", component_name("console")))["containers"][0])
        self.assertIn("SLUICE__KAFKA__SASL_PASSWORD", env, "it reads Kafka with the release's credentials")
        self.assertNotIn("SLUICE__POSTGRES__URL", env)

    def test_config_points_the_console_at_the_services(self):
        documents = render(*self.ON, "--set", "console.port=9000")
        config = config_toml(documents)
        self.assertEqual(config_contract_errors(config), [])
        console = config["console"]
        self.assertEqual(console["listen"], "0.0.0.0:9000")
        for key, component in (("admission_endpoint", "admission"), ("limit_grant_endpoint", "limit-grant"),
                               ("rate_window_endpoint", "rate-window"),
                               ("refresh_dispatcher_endpoint", "refresh-dispatcher")):
            service = named(documents, "Service", component_name(component))
            port = [p for p in service["spec"]["ports"] if p["name"] == "grpc"][0]["port"]
            self.assertEqual(console[key], f"https://{service['metadata']['name']}.{NAMESPACE}.svc:{port}")
        service = named(documents, "Service", component_name("console"))
        deployment = named(documents, "Deployment", component_name("console"))
        self.assertTrue(selects(service["spec"]["selector"], pod_spec_labels(deployment)))
        self.assertEqual([(p["name"], p["port"]) for p in service["spec"]["ports"]], [("http", 9000)])
        with_metrics = render(*self.ON, "--set", "metrics.enabled=true")
        ports = named(with_metrics, "Service", component_name("console"))["spec"]["ports"]
        self.assertEqual([p["name"] for p in ports], ["http", "metrics"], "scraped like the services")
        self.assertRenderFails(*self.ON, "--set", "metrics.enabled=true", "--set", "console.port=9090",
                               message="collides with console.port")
        for component in COMPONENTS:
            other = named(documents, "Deployment", component_name(component))
            self.assertFalse(selects(service["spec"]["selector"], pod_spec_labels(other)), component)
            other_service = named(documents, "Service", component_name(component))
            self.assertFalse(selects(other_service["spec"]["selector"], pod_spec_labels(deployment)), component)

    def test_ingress_routes_to_the_console_service(self):
        self.assertEqual(of_kind(render(*self.ON), "Ingress"), [])
        documents = render(*self.ON, "--set", "console.ingress.enabled=true",
                           "--set", "console.ingress.host=console.example.com",
                           "--set-json", 'networkPolicy.consoleFrom=[{"podSelector":{}}]')
        ingress = named(documents, "Ingress", component_name("console"))
        rule = ingress["spec"]["rules"][0]
        self.assertEqual(rule["host"], "console.example.com")
        path = rule["http"]["paths"][0]
        self.assertEqual(path["path"], "/")
        self.assertEqual(path["backend"]["service"], {"name": component_name("console"), "port": {"name": "http"}})

    def test_invalid_console_values_are_refused(self):
        for case in (("--set", "console.port=70000"), ("--set", "console.enabled=yes"),
                     ("--set", "console.config.refreshInterval=soon"), ("--set", "console.ingress.path=console"),
                     ("--set", "console.config.traceUrlTemplate=javascript:alert(1)"),
                     ("--set", "console.replicaz=2")):
            with self.subTest(case=case):
                with self.assertRaises(RenderError):
                    render(*self.ON, *case)


# ---------------------------------------------------------------------------
# Secure defaults: TLS, authentication, NetworkPolicies.

SERVING_DEPLOYMENTS = [*COMPONENTS, "console"]


def volumes_by_name(spec: dict) -> dict:
    return {volume["name"]: volume for volume in spec.get("volumes") or []}


def mounts_by_name(container: dict) -> dict:
    return {mount["name"]: mount for mount in container.get("volumeMounts") or []}


class TlsTest(ChartTestCase):
    """TLS is on by default: the chart refuses to render without a
    certificate, mounts the Secret into every serving pod, names its files in
    sluice.toml and turns every endpoint into https://."""

    def test_default_values_fail_saying_what_tls_needs(self):
        message = self.assertRenderFails(base=(), message="tls.enabled is true (the default) but no certificate")
        for hint in ("tls.existingSecret", "tls.crt, tls.key and ca.crt", "tls.certManager.enabled=true",
                     "tls.certManager.issuerRef.name", f"{RELEASE}-sluice.{NAMESPACE}.svc (tls.serverName)",
                     "tls.enabled=false", "service mesh"):
            self.assertIn(hint, message)
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        self.assertIs(values["tls"]["enabled"], True)
        self.assertIs(values["auth"]["enabled"], True)

    def test_inconsistent_tls_values_fail(self):
        self.assertRenderFails("--set", "tls.certManager.enabled=true",
                               "--set", "tls.certManager.issuerRef.name=ca",
                               message="choose one source for the certificate")
        self.assertRenderFails("--set", "tls.existingSecret=", "--set", "tls.certManager.enabled=true",
                               message="tls.certManager.enabled needs tls.certManager.issuerRef.name")
        self.assertRenderFails("--set", "tls.enabled=false", "--set", "tls.mutual=true",
                               message="tls.mutual needs tls.enabled")

    def test_cert_manager_certificate_names_every_service_and_the_server_name(self):
        for server_name, args in ((f"{RELEASE}-sluice.{NAMESPACE}.svc", ()),
                                  ("sluice.internal", ("--set", "tls.serverName=sluice.internal"))):
            with self.subTest(server_name=server_name):
                documents = render(*CERT_MANAGER, *args,
                                   "--set-json", 'tls.certManager.extraDnsNames=["admission.example.com"]')
                certificate = named(documents, "Certificate", f"{RELEASE}-sluice-tls")
                self.assertEqual(certificate["apiVersion"], "cert-manager.io/v1")
                spec = certificate["spec"]
                self.assertEqual(spec["secretName"], f"{RELEASE}-sluice-tls")
                self.assertEqual(spec["issuerRef"], {"name": "internal-ca", "kind": "Issuer",
                                                     "group": "cert-manager.io"})
                self.assertEqual((spec["duration"], spec["renewBefore"]), ("2160h", "360h"))
                self.assertTrue({"server auth", "client auth"} <= set(spec["usages"]), "usable for mutual TLS")
                expected = {server_name, "admission.example.com"}
                for component in COMPONENTS:
                    service = named(documents, "Service", component_name(component))["metadata"]["name"]
                    expected |= {service, f"{service}.{NAMESPACE}", f"{service}.{NAMESPACE}.svc",
                                 f"{service}.{NAMESPACE}.svc.cluster.local"}
                self.assertEqual(set(spec["dnsNames"]), expected)
                self.assertEqual(len(spec["dnsNames"]), len(expected), "no duplicates")
                self.assertEqual(config_toml(documents)["tls"]["server_name"], server_name)
                # The pods mount the Secret cert-manager writes.
                for component in COMPONENTS:
                    spec_ = pod_spec(named(documents, "Deployment", component_name(component)))
                    self.assertEqual(volumes_by_name(spec_)["tls"]["secret"]["secretName"], f"{RELEASE}-sluice-tls")
        self.assertEqual(of_kind(render(), "Certificate"), [], "an existing Secret needs no Certificate")
        self.assertEqual(of_kind(render(*CERT_MANAGER, "--set", "tls.enabled=false"), "Certificate"), [])
        certificate = of_kind(render("--values", str(PRODUCTION_VALUES)), "Certificate")[0]
        self.assertEqual(certificate["spec"]["issuerRef"]["kind"], "ClusterIssuer")

    def test_existing_secret_is_mounted_into_every_serving_pod(self):
        documents = render(*ConsoleTest.ON)
        config = config_toml(documents)
        for component in SERVING_DEPLOYMENTS:
            with self.subTest(component=component):
                spec = pod_spec(named(documents, "Deployment", component_name(component)))
                volume = volumes_by_name(spec)["tls"]["secret"]
                self.assertEqual(volume["secretName"], TLS_SECRET)
                self.assertEqual(sorted(item["key"] for item in volume["items"]), ["ca.crt", "tls.crt", "tls.key"])
                self.assertEqual(volume["defaultMode"] & 0o007, 0, "the key is not world-readable")
                mount = mounts_by_name(spec["containers"][0])["tls"]
                self.assertEqual(mount["mountPath"], TLS_DIR)
                self.assertIs(mount["readOnly"], True)
                self.assertNotIn("subPath", mount, "a subPath mount would never see a rotated certificate")
        # The configuration names the mounted files.
        self.assertEqual(config["tls"], {
            "cert_file": f"{TLS_DIR}/tls.crt", "key_file": f"{TLS_DIR}/tls.key",
            "client_ca_file": "", "ca_file": f"{TLS_DIR}/ca.crt",
            "server_name": f"{RELEASE}-sluice.{NAMESPACE}.svc", "reload_interval": "10s",
        })
        # The hook Jobs serve nothing: no certificate, no token.
        for job in of_kind(documents, "Job"):
            self.assertEqual(set(volumes_by_name(pod_spec(job))), {"config", "tmp"}, job["metadata"]["name"])

    def test_mutual_tls_requires_client_certificates(self):
        config = config_toml(render("--set", "tls.mutual=true", "--set", "tls.reloadInterval=1m"))
        self.assertEqual(config["tls"]["client_ca_file"], f"{TLS_DIR}/ca.crt")
        self.assertEqual(config["tls"]["reload_interval"], "1m")

    def test_endpoints_are_https_with_tls(self):
        for args, scheme, base in (((), "https", None), (("--set", "tls.enabled=false"), "http", None),
                                   (INSECURE, "http", ())):
            with self.subTest(args=args):
                documents = render(*ConsoleTest.ON, *args, base=base)
                config = config_toml(documents)
                endpoints = [config["admission"]["limit_grant_endpoint"], config["admission"]["rate_window_endpoint"],
                             *(config["console"][key] for key in ("admission_endpoint", "limit_grant_endpoint",
                                                                  "rate_window_endpoint", "refresh_dispatcher_endpoint"))]
                for endpoint in endpoints:
                    self.assertTrue(endpoint.startswith(f"{scheme}://"), endpoint)
                if scheme == "http":
                    self.assertEqual(config["tls"]["cert_file"], "")
                    self.assertEqual(config["tls"]["ca_file"], "")
                    for component in SERVING_DEPLOYMENTS:
                        spec = pod_spec(named(documents, "Deployment", component_name(component)))
                        self.assertNotIn("tls", volumes_by_name(spec))


class OtlpTlsTest(ChartTestCase):
    """An https:// OTLP endpoint is checked with the CA from a Secret the
    chart mounts into every serving pod (telemetry.otlp_ca_file); without
    one the chart refuses to render, saying what to set."""

    OTLP = "https://otlp.example.com:4317"

    def test_https_without_a_ca_fails_saying_what_to_set(self):
        message = self.assertRenderFails("--set", f"telemetry.otlpEndpoint={self.OTLP}",
                                         message="telemetry.otlpCa.existingSecret is empty")
        self.assertIn("http:// collector", message)

    def test_the_ca_is_mounted_and_configured(self):
        documents = render(*ConsoleTest.ON, "--set", f"telemetry.otlpEndpoint={self.OTLP}",
                           "--set", "telemetry.otlpCa.existingSecret=collector-ca", "--set", "telemetry.otlpCa.key=root.pem")
        config = config_toml(documents)
        self.assertEqual(config["telemetry"]["otlp_endpoint"], self.OTLP)
        self.assertEqual(config["telemetry"]["otlp_ca_file"], OTLP_CA_FILE)
        self.assertEqual(config_contract_errors(config), [])
        for component in SERVING_DEPLOYMENTS:
            with self.subTest(component=component):
                spec = pod_spec(named(documents, "Deployment", component_name(component)))
                volume = volumes_by_name(spec)["otlp-ca"]["secret"]
                self.assertEqual(volume["secretName"], "collector-ca")
                self.assertEqual(volume["items"], [{"key": "root.pem", "path": Path(OTLP_CA_FILE).name}])
                mount = mounts_by_name(spec["containers"][0])["otlp-ca"]
                self.assertEqual(mount["mountPath"], str(Path(OTLP_CA_FILE).parent))
                self.assertIs(mount["readOnly"], True)

    def test_plain_http_mounts_no_ca(self):
        documents = render("--set", "telemetry.otlpEndpoint=http://collector:4317")
        self.assertNotIn("otlp_ca_file", config_toml(documents)["telemetry"])
        spec = pod_spec(named(documents, "Deployment", component_name("admission")))
        self.assertNotIn("otlp-ca", volumes_by_name(spec))


class AuthTest(ChartTestCase):
    """Authentication is on by default: the chart refuses to render without
    a way to authenticate callers, creates (or takes) the internal token and
    mounts it, with the JWKS, into every serving pod."""

    def test_tls_without_auth_keys_fails_saying_what_auth_needs(self):
        message = self.assertRenderFails("--set", f"tls.existingSecret={TLS_SECRET}", base=(),
                                         message="auth.enabled is true (the default) but nothing can authenticate")
        for hint in ("auth.jwks.existingSecret", "auth.issuer and auth.audience", "auth.clientCertificates",
                     "tls.mutual=true", "auth.enabled=false"):
            self.assertIn(hint, message)

    def test_jwks_needs_issuer_and_audience(self):
        for unset in ("auth.issuer", "auth.audience"):
            with self.subTest(unset=unset):
                self.assertRenderFails("--set", f"{unset}=",
                                       message="is set without auth.issuer and auth.audience")

    def test_generated_internal_token(self):
        documents = render(*ConsoleTest.ON)
        secret = named(documents, "Secret", f"{RELEASE}-sluice-internal-token")
        self.assertEqual(set(secret["data"]), {"internal-token"})
        token = base64.b64decode(secret["data"]["internal-token"]).decode()
        self.assertRegex(token, r"^[A-Za-z0-9]{48}$")
        self.assertEqual(config_toml(documents)["auth"]["internal_token_file"], TOKEN_FILE)
        for component in SERVING_DEPLOYMENTS:
            with self.subTest(component=component):
                spec = pod_spec(named(documents, "Deployment", component_name(component)))
                volume = volumes_by_name(spec)["internal-token"]["secret"]
                self.assertEqual(volume["secretName"], f"{RELEASE}-sluice-internal-token")
                self.assertEqual(volume["items"], [{"key": "internal-token", "path": Path(TOKEN_FILE).name}])
                mount = mounts_by_name(spec["containers"][0])["internal-token"]
                self.assertEqual(mount["mountPath"], str(Path(TOKEN_FILE).parent))
                self.assertIs(mount["readOnly"], True)
        for job in of_kind(documents, "Job"):
            self.assertNotIn("internal-token", volumes_by_name(pod_spec(job)))

    def test_generated_token_survives_upgrades(self):
        """helm template has no cluster to look the live Secret up in, so
        this reads the template: an upgrade must reuse the token the live
        Secret holds, or the pods of the old and new ReplicaSets would not
        accept each other's calls."""
        template = (CHART / "templates" / "secret-internal-token.yaml").read_text()
        self.assertIn('lookup "v1" "Secret" .Release.Namespace $name', template)
        self.assertIn("randAlphaNum 48", template)

    def test_existing_internal_token_secret(self):
        documents = render("--set", "auth.internalToken.existingSecret=shared-token",
                           "--set", "auth.internalToken.key=token")
        self.assertEqual(of_kind(documents, "Secret"), [])
        for component in COMPONENTS:
            volume = volumes_by_name(pod_spec(named(documents, "Deployment", component_name(component))))
            self.assertEqual(volume["internal-token"]["secret"]["secretName"], "shared-token")
            self.assertEqual(volume["internal-token"]["secret"]["items"], [{"key": "token", "path": "token"}])

    def test_jwks_is_mounted_and_configured(self):
        documents = render("--set", "auth.jwks.key=keys.json", "--set", "auth.tenantsClaim=tenants",
                           "--set", "auth.rolesClaim=roles", "--set", "auth.leeway=1m")
        auth = config_toml(documents)["auth"]
        self.assertEqual(auth, {
            "enabled": True, "internal_token_file": TOKEN_FILE, "jwks_file": JWKS_FILE,
            "issuer": ISSUER, "audience": AUDIENCE, "tenants_claim": "tenants", "roles_claim": "roles",
            "leeway": "1m", "reload_interval": "10s", "client_certificates": [],
        })
        for component in COMPONENTS:
            spec = pod_spec(named(documents, "Deployment", component_name(component)))
            volume = volumes_by_name(spec)["jwks"]["secret"]
            self.assertEqual(volume["secretName"], JWKS_SECRET)
            self.assertEqual(volume["items"], [{"key": "keys.json", "path": Path(JWKS_FILE).name}])
            mount = mounts_by_name(spec["containers"][0])["jwks"]
            self.assertEqual(mount["mountPath"], str(Path(JWKS_FILE).parent))
            self.assertIs(mount["readOnly"], True)

    CLIENT_CERTIFICATES = CLIENT_CERTIFICATES

    def test_client_certificates_become_toml_tables(self):
        documents = render(*self.CLIENT_CERTIFICATES)
        config_map = named(documents, "ConfigMap", f"{RELEASE}-sluice-config")
        self.assertEqual(config_map["data"]["sluice.toml"].count("[[auth.client_certificates]]"), 2)
        config = config_toml(documents)
        self.assertEqual(config["auth"]["client_certificates"], [
            {"name": "worker.payments.svc", "tenants": ["payments"], "roles": ["worker"]},
            {"name": "ops", "tenants": [], "roles": ["admin", "reader"]},
        ])
        self.assertEqual(config["auth"]["jwks_file"], "")
        self.assertEqual(config_contract_errors(config), [])
        self.assertNotIn("jwks", volumes_by_name(pod_spec(named(documents, "Deployment", component_name("admission")))))

    def test_client_certificates_need_mutual_tls(self):
        self.assertRenderFails(*self.CLIENT_CERTIFICATES, "--set", "tls.mutual=false",
                               message="auth.clientCertificates needs tls.enabled=true and tls.mutual=true")

    def test_invalid_client_certificates_are_refused(self):
        for mapping in ('{"name":"w","roles":["boss"]}', '{"name":"w","tenants":["*"],"roles":["worker"]}',
                        '{"name":"","roles":["worker"]}', '{"name":"w","role":["worker"]}', '{"name":"w"}'):
            with self.subTest(mapping=mapping):
                with self.assertRaises(RenderError):
                    render("--set", "tls.mutual=true", "--set-json", f"auth.clientCertificates=[{mapping}]")

    def test_opting_out_for_a_throwaway_cluster(self):
        documents = render(*INSECURE, base=())
        config = config_toml(documents)
        self.assertIs(config["auth"]["enabled"], False)
        self.assertEqual(config["auth"]["internal_token_file"], "")
        self.assertEqual(config["auth"]["jwks_file"], "")
        self.assertEqual(of_kind(documents, "Secret"), [])
        for component in COMPONENTS:
            spec = pod_spec(named(documents, "Deployment", component_name(component)))
            self.assertEqual(set(volumes_by_name(spec)), {"config", "tmp"})
        # TLS with auth off, and auth off with a JWKS Secret named: nothing of
        # auth is mounted.
        documents = render("--set", "auth.enabled=false")
        spec = pod_spec(named(documents, "Deployment", component_name("admission")))
        self.assertEqual(set(volumes_by_name(spec)), {"config", "tmp", "tls"})

    def test_grpc_reflection_value(self):
        self.assertIs(config_toml(render())["process"]["grpc_reflection"], True)
        self.assertIs(config_toml(render("--set", "grpcReflection=false"))["process"]["grpc_reflection"], False)


class NetworkPolicyTest(ChartTestCase):
    """NetworkPolicies are on by default: gRPC from the release's pods and
    the namespace's, metrics from the monitoring namespace, the console only
    from consoleFrom, egress unrestricted."""

    MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}

    def test_on_by_default(self):
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        self.assertIs(values["networkPolicy"]["enabled"], True)
        documents = render()
        policies = of_kind(documents, "NetworkPolicy")
        self.assertEqual(sorted(p["metadata"]["name"] for p in policies),
                         sorted(component_name(c) for c in COMPONENTS))
        release = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "sluice",
                                                   "app.kubernetes.io/instance": RELEASE}}}
        for policy in policies:
            where = policy["metadata"]["name"]
            spec = policy["spec"]
            # Egress stays open: Kafka, PostgreSQL, DNS and OTLP are outside.
            self.assertEqual(spec["policyTypes"], ["Ingress"], where)
            self.assertNotIn("egress", spec, where)
            self.assertEqual(len(spec["ingress"]), 1, f"{where}: no metrics rule without metrics")
            rule = spec["ingress"][0]
            self.assertEqual(rule["ports"], [{"port": "grpc", "protocol": "TCP"}])
            # The release's pods, and every pod of the release's namespace.
            self.assertEqual(rule["from"], [release, {"podSelector": {}}], where)

    def test_metrics_are_scraped_from_the_monitoring_namespace(self):
        documents = render(*ConsoleTest.ON, "--set", "metrics.enabled=true")
        policies = of_kind(documents, "NetworkPolicy")
        self.assertEqual(len(policies), 5)
        for policy in policies:
            rules = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "metrics"]
            self.assertEqual(len(rules), 1, policy["metadata"]["name"])
            self.assertEqual(rules[0]["from"], [self.MONITORING])
        documents = render("--set", "metrics.enabled=true",
                           "--set-json", 'networkPolicy.metricsFrom=[{"namespaceSelector":{"matchLabels":{"team":"obs"}}}]')
        for policy in of_kind(documents, "NetworkPolicy"):
            rule = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "metrics"][0]
            self.assertEqual(rule["from"], [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}])

    def test_console_policy_admits_only_console_from(self):
        documents = render(*ConsoleTest.ON)
        policy = named(documents, "NetworkPolicy", component_name("console"))
        deployment = named(documents, "Deployment", component_name("console"))
        self.assertTrue(selects(policy["spec"]["podSelector"]["matchLabels"], pod_spec_labels(deployment)))
        for component in COMPONENTS:
            other = named(documents, "Deployment", component_name(component))
            self.assertFalse(selects(policy["spec"]["podSelector"]["matchLabels"], pod_spec_labels(other)))
        self.assertEqual(policy["spec"]["ingress"], [], "no login: nothing reaches it but port-forward")
        documents = render(*ConsoleTest.ON, "--set-json",
                           'networkPolicy.consoleFrom=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"ingress-nginx"}}}]')
        rule = named(documents, "NetworkPolicy", component_name("console"))["spec"]["ingress"][0]
        self.assertEqual(rule["ports"], [{"port": "http", "protocol": "TCP"}])
        self.assertEqual(rule["from"][0]["namespaceSelector"]["matchLabels"],
                         {"kubernetes.io/metadata.name": "ingress-nginx"})
        self.assertRenderFails(*ConsoleTest.ON, "--set", "console.ingress.enabled=true",
                               message="needs networkPolicy.consoleFrom")

    def test_off_on_request(self):
        self.assertEqual(of_kind(render("--set", "networkPolicy.enabled=false"), "NetworkPolicy"), [])


def main() -> int:
    verbosity = 2 if "-v" in sys.argv else 1
    names = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    loader = unittest.TestLoader()
    if names:
        suite = loader.loadTestsFromNames(names, sys.modules[__name__])
    else:
        suite = loader.loadTestsFromModule(sys.modules[__name__])
    result = unittest.TextTestRunner(verbosity=verbosity, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors)
    passed = result.testsRun - failed - len(result.skipped)
    print(f"helm-chart: {passed} passed, {failed} failed")
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
