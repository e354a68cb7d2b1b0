#!/usr/bin/env python3
"""Checks deploy/ by reading it (no Docker engine runs here): the Dockerfile,
its .dockerignore, docker-compose.yml, the OpenTelemetry Collector,
Prometheus and Grafana files, against the workspace and the Helm chart.

Run by scripts/helm-check.sh with the tools venv's Python (needs PyYAML):

    python3 tests/helm/test_deploy.py [-v]
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
import unittest
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_contract import DEFAULT_TOML, config_contract_errors, deep_merge, missing_required_fields  # noqa: E402

try:
    import yaml
except ModuleNotFoundError:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = Path(os.environ.get("SLUICE_TOOLS_DIR") or cache / "sluice" / "tools") / "venv"
    if (venv / "bin" / "python").exists() and Path(sys.prefix).resolve() != venv.resolve():
        os.execv(str(venv / "bin" / "python"), [str(venv / "bin" / "python"), __file__, *sys.argv[1:]])
    sys.exit("PyYAML is missing: run scripts/install-helm-tools.sh (or scripts/helm-check.sh)")

DEPLOY = ROOT / "deploy"
DOCKERFILE = Path(os.environ.get("SLUICE_DOCKERFILE") or DEPLOY / "Dockerfile")
DOCKERIGNORE = DOCKERFILE.parent / f"{DOCKERFILE.name}.dockerignore"
COMPOSE = DEPLOY / "docker-compose.yml"
COLLECTOR = DEPLOY / "otel-collector.yaml"
CHART_TEMPLATES = ROOT / "helm" / "sluice" / "templates"
SERVICES = ("admission", "limit-grant", "rate-window", "refresh-dispatcher")


# --- the workspace ----------------------------------------------------------

@lru_cache(maxsize=None)
def workspace_members() -> tuple[Path, ...]:
    manifest = tomllib.loads((ROOT / "Cargo.toml").read_text())
    members = []
    for pattern in manifest["workspace"]["members"]:
        members.extend(sorted(path for path in ROOT.glob(pattern) if (path / "Cargo.toml").exists()))
    return tuple(members)


def package_binaries(member: Path) -> tuple[str, list[str]]:
    """(package name, binary names) of one member."""
    manifest = tomllib.loads((member / "Cargo.toml").read_text())
    package = manifest["package"]["name"]
    binaries = [entry["name"] for entry in manifest.get("bin", [])]
    if (member / "src" / "main.rs").exists() and package not in binaries and not any(
            entry.get("path") == "src/main.rs" for entry in manifest.get("bin", [])):
        binaries.append(package)
    return package, binaries


def shipped_packages() -> dict[str, list[str]]:
    """Packages under crates/ that have binaries: what the image must ship.
    (tests/ holds the benchmark binary, which is not part of the image.)"""
    shipped = {}
    for member in workspace_members():
        if member.parent.name != "crates":
            continue
        package, binaries = package_binaries(member)
        if binaries:
            shipped[package] = binaries
    return shipped


# --- the Dockerfile -------------------------------------------------------------

def dockerfile_stages() -> list[dict]:
    """Stages with their FROM line and instructions (continuations joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[dict] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        instruction, _, argument = stripped.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            name = re.search(r"\bAS\s+(\S+)", argument, re.IGNORECASE)
            stages.append({"from": argument, "name": name.group(1) if name else None, "lines": []})
        elif stages:
            stages[-1]["lines"].append((instruction, argument.strip()))
    return stages


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line[1:] if include else line
        pattern = pattern.strip("/")
        expression = ""
        index = 0
        while index < len(pattern):
            if pattern.startswith("**/", index):
                expression += "(?:.*/)?"
                index += 3
            elif pattern.startswith("**", index):
                expression += ".*"
                index += 2
            elif pattern[index] == "*":
                expression += "[^/]*"
                index += 1
            elif pattern[index] == "?":
                expression += "[^/]"
                index += 1
            else:
                expression += re.escape(pattern[index])
                index += 1
        rules.append((include, re.compile(f"^{expression}$")))
    return rules


def excluded_from_context(relative: str) -> bool:
    """Whether the build context leaves out this path (Docker's rules: the
    last matching pattern wins; a path is out when it or a parent matches)."""
    parts = relative.strip("/").split("/")
    excluded = False
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        for include, pattern in dockerignore_rules():
            if pattern.match(prefix):
                excluded = not include
    return excluded


class DockerfileTest(unittest.TestCase):
    def test_runtime_runs_as_non_root(self):
        runtime = dockerfile_stages()[-1]
        users = [argument for instruction, argument in runtime["lines"] if instruction == "USER"]
        self.assertTrue(users, "the runtime stage sets no USER")
        user = users[-1]
        # Numeric, so the kubelet can enforce runAsNonRoot without /etc/passwd.
        self.assertRegex(user, r"^[0-9]+(:[0-9]+)?$")
        self.assertNotEqual(int(user.split(":")[0]), 0)
        self.assertNotIn("--from=builder /src", " ".join(a for _, a in runtime["lines"]),
                         "the runtime image should copy binaries only")

    def test_is_multi_stage_with_a_slim_runtime(self):
        stages = dockerfile_stages()
        self.assertGreaterEqual(len(stages), 2)
        self.assertIn("rust:", stages[0]["from"])
        self.assertNotIn("rust:", stages[-1]["from"])

    def test_builds_and_ships_every_service_binary_and_the_cli(self):
        builder = dockerfile_stages()[0]
        build = " ".join(a for i, a in builder["lines"] if i == "RUN" and "cargo build" in a)
        self.assertIn("--locked", build)
        self.assertIn("--release", build)
        copied = re.search(r"for binary in ([^;]+);", build)
        self.assertIsNotNone(copied, "no loop copying the binaries out")
        copied_binaries = set(copied.group(1).split())
        shipped = shipped_packages()
        self.assertEqual(set(shipped), {"sluice-cli", "sluice-console", *(f"sluice-{service}" for service in SERVICES)})
        for package, binaries in shipped.items():
            if "--workspace" not in build:
                self.assertRegex(build, rf"-p\s+{re.escape(package)}\b", f"{package} is not built")
            for binary in binaries:
                self.assertIn(binary, copied_binaries, f"{binary} is built but not shipped")
        runtime = dockerfile_stages()[-1]
        self.assertTrue(any(i == "COPY" and "/usr/local/bin" in a for i, a in runtime["lines"]))

    def test_copies_the_whole_workspace(self):
        builder = dockerfile_stages()[0]
        copies = [argument for instruction, argument in builder["lines"] if instruction == "COPY"]
        self.assertIn(". .", copies, "copy the whole workspace (COPY . .), not a list of crates: "
                                     "cargo needs every member named in Cargo.toml")
        needed = ["Cargo.toml", "Cargo.lock", "proto/sluice/v1"]
        needed += [str(member.relative_to(ROOT)) + "/Cargo.toml" for member in workspace_members()]
        needed += [str(member.relative_to(ROOT)) + "/src" for member in workspace_members()]
        for member in workspace_members():
            if (member / "migrations").exists():
                needed.append(str(member.relative_to(ROOT)) + "/migrations")
            if (member / "build.rs").exists():
                needed.append(str(member.relative_to(ROOT)) + "/build.rs")
        for path in needed:
            self.assertFalse(excluded_from_context(path), f"{path} is left out of the build context")
        # The console's page assets are compiled in (include_str!).
        self.assertFalse(excluded_from_context("crates/sluice-console/assets/console.js"))
        for path in (".git", "target", "helm/sluice/values.yaml", "crates/sluice-cli/target/x"):
            self.assertTrue(excluded_from_context(path), f"{path} should stay out of the build context")

    def test_a_new_crate_would_be_in_the_context(self):
        # e.g. crates/sluice-client, soon.
        self.assertFalse(excluded_from_context("crates/sluice-client/Cargo.toml"))
        self.assertFalse(excluded_from_context("crates/sluice-client/src/lib.rs"))

    def test_chart_and_compose_only_run_shipped_binaries(self):
        shipped = {binary for binaries in shipped_packages().values() for binary in binaries}
        used = set()
        for template in CHART_TEMPLATES.rglob("*"):
            if template.is_file():
                used |= set(re.findall(r"/usr/local/bin/([a-z0-9-]+)", template.read_text()))
        helpers = (CHART_TEMPLATES / "_helpers.tpl").read_text()
        used |= set(re.findall(r"binary: ([a-z0-9-]+)", helpers))
        compose = yaml.safe_load(COMPOSE.read_text())
        for service in compose["services"].values():
            if service.get("image", "").startswith("sluice"):
                command = service.get("command") or []
                used.add(command[0])
                healthcheck = (service.get("healthcheck") or {}).get("test") or []
                if healthcheck[:1] == ["CMD"]:
                    used.add(healthcheck[1])
        self.assertTrue(used)
        self.assertEqual(used - shipped, set())


# --- docker-compose.yml ---------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def sluice_services(document: dict) -> dict:
    return {name: service for name, service in document["services"].items()
            if str(service.get("image", "")).startswith("sluice")}


class ComposeTest(unittest.TestCase):
    def test_has_the_stack(self):
        services = compose()["services"]
        for name in ("kafka", "postgres", "otel-collector", "jaeger", "prometheus", "grafana",
                     "migrate", "topics", *SERVICES):
            self.assertIn(name, services)
        roles = services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
        self.assertEqual(set(roles.split(",")), {"broker", "controller"}, "Kafka in KRaft mode")
        self.assertNotIn("zookeeper", services)

    def test_services_wait_for_migrations_and_topics(self):
        services = compose()["services"]
        for name in SERVICES:
            depends = services[name]["depends_on"]
            self.assertEqual(depends["migrate"]["condition"], "service_completed_successfully", name)
            self.assertEqual(depends["topics"]["condition"], "service_completed_successfully", name)
        self.assertEqual(services["topics"]["command"][:3], ["sluice", "topics", "ensure"])

    def test_sluice_containers_are_hardened(self):
        for name, service in sluice_services(compose()).items():
            self.assertRegex(str(service.get("user")), r"^[1-9][0-9]*:[0-9]+$", name)
            self.assertIs(service.get("read_only"), True, name)
            self.assertIn("ALL", service.get("cap_drop") or [], name)
            self.assertIn("no-new-privileges:true", service.get("security_opt") or [], name)

    def test_mounted_files_exist(self):
        for name, service in compose()["services"].items():
            for volume in service.get("volumes") or []:
                source = volume.split(":")[0]
                if source.startswith("."):
                    self.assertTrue((DEPLOY / source).exists(), f"{name} mounts missing {source}")

    def test_compose_config_is_one_the_services_accept(self):
        config = tomllib.loads((DEPLOY / "sluice.compose.toml").read_text())
        self.assertEqual(config_contract_errors(config), [])
        layered = deep_merge(tomllib.loads(DEFAULT_TOML.read_text()), config)
        self.assertEqual(missing_required_fields(layered), [])
        # No credential in the file; it comes from the environment.
        self.assertNotIn("url", config.get("postgres", {}))
        self.assertEqual(config["telemetry"]["otlp_endpoint"], "http://otel-collector:4317")


# --- the collector, Prometheus and Grafana --------------------------------------

class ObservabilityTest(unittest.TestCase):
    def test_collector_pipelines_use_defined_components(self):
        config = yaml.safe_load(COLLECTOR.read_text())
        pipelines = config["service"]["pipelines"]
        self.assertIn("traces", pipelines)
        self.assertIn("metrics", pipelines, "the services export OTLP metrics too")
        for name, pipeline in pipelines.items():
            for section in ("receivers", "processors", "exporters"):
                for component in pipeline.get(section, []):
                    self.assertIn(component, config.get(section) or {}, f"{name}: {section} {component}")
            # memory_limiter goes first when present.
            processors = pipeline.get("processors", [])
            if "memory_limiter" in processors:
                self.assertEqual(processors[0], "memory_limiter", name)
        for extension in config["service"].get("extensions", []):
            self.assertIn(extension, config.get("extensions") or {})
        self.assertEqual(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"], "0.0.0.0:4317")

    def test_prometheus_scrapes_the_collector_exporter(self):
        collector = yaml.safe_load(COLLECTOR.read_text())
        port = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
        prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        targets = [target for job in prometheus["scrape_configs"]
                   for static in job.get("static_configs", []) for target in static["targets"]]
        self.assertEqual(targets, [f"otel-collector:{port}"],
                         "scrape the collector only: the services' own /metrics too would double every sum")

    def test_grafana_loads_the_dashboard(self):
        provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "sluice.yaml").read_text())
        path = provider["providers"][0]["options"]["path"]
        grafana = compose()["services"]["grafana"]
        mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in grafana["volumes"]}
        dashboard_mounts = [target for target, source in mounts.items()
                            if source.endswith("sluice-dashboard.json")]
        self.assertEqual(len(dashboard_mounts), 1)
        self.assertTrue(dashboard_mounts[0].startswith(path.rstrip("/") + "/"))
        datasources = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
        source = datasources["datasources"][0]
        self.assertEqual(source["type"], "prometheus")
        self.assertTrue(source["url"].startswith("http://prometheus:"))


def main() -> int:
    verbosity = 2 if "-v" in sys.argv else 1
    result = unittest.TextTestRunner(verbosity=verbosity, stream=sys.stdout).run(
        unittest.TestLoader().loadTestsFromModule(sys.modules[__name__]))
    failed = len(result.failures) + len(result.errors)
    print(f"deploy: {result.testsRun - failed} passed, {failed} failed")
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
