#!/usr/bin/env python3
"""Checks the Grafana dashboard (deploy/grafana/sluice-dashboard.json)
against the metrics the code defines, so it cannot silently drift from them.

Run by scripts/helm-check.sh; standard library only:

    python3 tests/helm/test_dashboard.py [-v]

Metric names come from crates/sluice-common/src/metrics.rs: every instrument
built there (`meter.u64_counter("sluice_...")` and friends, with its
`.with_unit(..)`) becomes the Prometheus names that opentelemetry-prometheus
(and the Collector's Prometheus exporter) export:

    counter            <name>[_<unit>]_total
    histogram          <name>[_<unit>]_bucket, _sum, _count
    gauge, up-down     <name>[_<unit>]

with the unit spelled out (s -> seconds, ms -> milliseconds, By -> bytes,
1 -> ratio, ...). Labels come from the `KeyValue::new("label", ..)` calls in
the crates, plus the ones Prometheus adds.

SLUICE_DASHBOARD and SLUICE_METRICS_RS point the test at other files (e.g.
to check that a deliberately broken dashboard fails it).
"""

from __future__ import annotations

import json
import os
import re
import sys
import unittest
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = Path(os.environ.get("SLUICE_DASHBOARD") or ROOT / "deploy" / "grafana" / "sluice-dashboard.json")
METRICS_RS = Path(os.environ.get("SLUICE_METRICS_RS") or ROOT / "crates" / "sluice-common" / "src" / "metrics.rs")
CRATES = ROOT / "crates"

# OpenTelemetry unit -> Prometheus suffix, as opentelemetry-prometheus maps
# them (only the units a Sluice metric could plausibly use).
UNIT_SUFFIXES = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
    "us": "microseconds", "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes",
    "MiBy": "mebibytes", "GiBy": "gibibytes", "1": "ratio", "%": "percent",
}

# Labels Prometheus (or the Prometheus Operator, or the Collector's exporter)
# puts on every series, and `le` on histogram buckets.
TARGET_LABELS = {"le", "job", "instance", "namespace", "pod", "container", "endpoint", "otel_scope_name"}

# Labels the dashboard may use before any code records them: {label: why}.
# Keep it empty unless a panel is deliberately ahead of the code; an entry
# the code has started recording fails the test so it gets dropped.
PENDING_LABELS: dict[str, str] = {}

# What the dashboard must cover (issue 7, item 5, and the Kafka/commit panels).
REQUIRED_FAMILIES = {
    "per-key utilisation": "sluice_key_utilization",
    "wait times": "sluice_wait_time_seconds",
    "per-key wait times": "sluice_key_wait_time_seconds",
    "queue depth": "sluice_key_waiting",
    "rate deferrals": "sluice_rate_deferrals_total",
    "refresh outcomes": "sluice_refresh_outcomes_total",
    "grants": "sluice_grants_total",
    "dead letters": "sluice_dead_letters_total",
    "kafka consumed": "sluice_kafka_consumed_messages_total",
    "kafka produced": "sluice_kafka_produced_messages_total",
    "kafka publish latency": "sluice_kafka_publish_duration_seconds",
    "commit latency": "sluice_commit_duration_seconds",
}

INSTRUMENT = re.compile(
    r"\.(?P<method>(?:u64|i64|f64)_(?:observable_)?(?:up_down_counter|counter|histogram|gauge))"
    r"\(\s*\"(?P<name>sluice_[a-z0-9_]+)\"\s*\)"
)
# Where a builder chain ends.
BUILD = re.compile(r"\.build\(\)")
UNIT = re.compile(r"\.with_unit\(\s*\"([^\"]*)\"\s*\)")


class Instrument:
    def __init__(self, name: str, method: str, unit: str):
        self.name = name
        self.method = method
        self.unit = unit

    @property
    def kind(self) -> str:
        if "up_down_counter" in self.method or "gauge" in self.method:
            return "gauge"
        if "counter" in self.method:
            return "counter"
        return "histogram"

    @property
    def base(self) -> str:
        if not self.unit:
            return self.name
        if self.unit not in UNIT_SUFFIXES:
            raise ValueError(f"{self.name}: unit {self.unit!r} unknown to this test; add its suffix")
        return f"{self.name}_{UNIT_SUFFIXES[self.unit]}"

    def exported(self) -> set[str]:
        if self.kind == "counter":
            return {f"{self.base}_total"}
        if self.kind == "histogram":
            return {f"{self.base}_bucket", f"{self.base}_sum", f"{self.base}_count"}
        return {self.base}

    def family(self) -> str:
        return f"{self.base}_total" if self.kind == "counter" else self.base


def instruments(source: str) -> list[Instrument]:
    found = []
    for match in INSTRUMENT.finditer(source):
        end = BUILD.search(source, match.end())
        chain = source[match.end(): end.start() if end else len(source)]
        unit = UNIT.search(chain)
        found.append(Instrument(match.group("name"), match.group("method"), unit.group(1) if unit else ""))
    return found


@lru_cache(maxsize=None)
def defined_instruments() -> tuple[Instrument, ...]:
    return tuple(instruments(METRICS_RS.read_text()))


def exported_names() -> dict[str, Instrument]:
    names = {}
    for instrument in defined_instruments():
        for name in instrument.exported():
            names[name] = instrument
    return names


@lru_cache(maxsize=None)
def recorded_labels() -> frozenset[str]:
    """Every literal attribute key the crates put on a metric or span."""
    labels = set()
    for path in CRATES.rglob("*.rs"):
        labels.update(re.findall(r"KeyValue::new\(\s*\"([a-z_][a-z0-9_.]*)\"", path.read_text()))
    return frozenset(labels)


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    found = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))  # collapsed rows
    return found


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    found = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                found.append((f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        found.append((f"variable {variable['name']}", text or ""))
        if variable.get("definition"):
            found.append((f"variable {variable['name']} definition", variable["definition"]))
    return found


PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "by", "without", "rate", "irate",
    "increase", "histogram_quantile", "label_values", "on", "ignoring", "group_left",
    "group_right", "and", "or", "unless", "offset", "bool", "clamp_min", "clamp_max",
    "abs", "vector", "scalar", "time", "sort", "sort_desc", "delta", "deriv", "quantile",
}


def metric_names_in(expression: str) -> set[str]:
    """Identifiers that name a metric: not inside a string, not a label inside
    {...} or by (...), not a PromQL function or keyword."""
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expression)
    without_selectors = re.sub(r"\{[^}]*\}", "{}", without_strings)
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", without_selectors)
    without_ranges = re.sub(r"\[[^\]]*\]", "[]", without_groupings)
    # label_values(metric, label): the second argument is a label.
    without_label_args = re.sub(r"(label_values\([^,()]*(?:\{\})?\s*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)", r"\1)", without_ranges)
    names = set()
    for token in re.findall(r"(?<![\w$.])[a-zA-Z_:][a-zA-Z0-9_:]*", without_label_args):
        if token in PROMQL_WORDS or token.startswith("__"):
            continue
        names.add(token)
    return names


def matched_label_values(expression: str) -> list[tuple[str, str]]:
    """(label, value) for every literal value a matcher compares a label
    with; a regex alternation (a|b) gives one pair per alternative. Values
    holding a dashboard variable ($...) or regex syntax beyond `|` are
    skipped."""
    pairs = []
    for selector in re.findall(r"\{([^}]*)\}", expression):
        for label, value in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', selector):
            if "$" in value or re.search(r"[.*+?()\[\]{}^\\]", value):
                continue
            pairs.extend((label, alternative) for alternative in value.split("|") if alternative)
    return pairs


@lru_cache(maxsize=None)
def rust_string_literals() -> frozenset[str]:
    literals = set()
    for path in CRATES.rglob("*.rs"):
        literals.update(re.findall(r'"([^"\\\n]*)"', path.read_text()))
    return frozenset(literals)


def labels_in(expression: str) -> set[str]:
    labels = set()
    for selector in re.findall(r"\{([^}]*)\}", re.sub(r'"(?:[^"\\]|\\.)*"', '""', expression)):
        labels.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
    for grouping in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expression):
        labels.update(label.strip() for label in grouping.split(",") if label.strip())
    for label in re.findall(r"label_values\([^,()]*(?:\{[^}]*\})?\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)", expression):
        labels.add(label)
    return labels


class MetricsSourceTest(unittest.TestCase):
    """The reading of metrics.rs itself, so an empty parse cannot pass."""

    def test_instruments_are_found(self):
        found = {instrument.name: instrument for instrument in defined_instruments()}
        self.assertGreaterEqual(len(found), 10, "too few instruments parsed from metrics.rs")
        source = METRICS_RS.read_text()
        self.assertEqual(len(found), len(set(re.findall(r"\"(sluice_[a-z0-9_]+)\"", source))),
                         "a \"sluice_...\" name in metrics.rs was not recognised as an instrument")

    def test_suffix_rules(self):
        self.assertEqual(Instrument("sluice_x", "u64_counter", "").exported(), {"sluice_x_total"})
        self.assertEqual(Instrument("sluice_x", "f64_histogram", "s").exported(),
                         {"sluice_x_seconds_bucket", "sluice_x_seconds_sum", "sluice_x_seconds_count"})
        self.assertEqual(Instrument("sluice_x", "f64_observable_gauge", "").exported(), {"sluice_x"})
        self.assertEqual(Instrument("sluice_x", "i64_up_down_counter", "By").exported(), {"sluice_x_bytes"})

    def test_parsing_a_builder_chain(self):
        source = '''
            meter.f64_histogram("sluice_a").with_description("d").with_unit("s").build();
            meter.u64_counter("sluice_b").with_description("no unit").build();
            meter.u64_observable_gauge("sluice_c").with_callback(|o| {}).build();
        '''
        parsed = {instrument.name: instrument for instrument in instruments(source)}
        self.assertEqual(parsed["sluice_a"].exported(), {"sluice_a_seconds_bucket", "sluice_a_seconds_sum", "sluice_a_seconds_count"})
        self.assertEqual(parsed["sluice_b"].exported(), {"sluice_b_total"})
        self.assertEqual(parsed["sluice_c"].exported(), {"sluice_c"})

    def test_promql_reading(self):
        expression = ('histogram_quantile(0.95, sum by (le, kind) (rate(sluice_wait_time_seconds_bucket'
                      '{namespace=~"$namespace", kind="rate"}[$__rate_interval]))) / on (kind) sluice_other')
        self.assertEqual(metric_names_in(expression), {"sluice_wait_time_seconds_bucket", "sluice_other"})
        self.assertEqual(labels_in(expression), {"le", "kind", "namespace"})
        self.assertEqual(matched_label_values(expression), [("kind", "rate")])
        self.assertEqual(matched_label_values('x{outcome!~"failed|timed_out", key=~"$key", a=~"b.*"}'),
                         [("outcome", "failed"), ("outcome", "timed_out")])
        variable = 'label_values(sluice_key_holders{tenant=~"$tenant"}, key)'
        self.assertEqual(metric_names_in(variable), {"sluice_key_holders"})
        self.assertEqual(labels_in(variable), {"tenant", "key"})


class DashboardTest(unittest.TestCase):
    def test_is_a_grafana_dashboard(self):
        dashboard = load_dashboard()
        for field in ("title", "uid", "panels", "templating", "schemaVersion"):
            self.assertIn(field, dashboard)
        self.assertRegex(dashboard["uid"], r"^[a-zA-Z0-9_-]{1,40}$")
        ids = [panel["id"] for panel in all_panels(dashboard)]
        self.assertEqual(len(ids), len(set(ids)), "panel ids repeat")
        variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
        self.assertEqual(variables["datasource"]["type"], "datasource")
        self.assertEqual(variables["datasource"]["query"], "prometheus")
        for panel in all_panels(dashboard):
            if panel["type"] == "row":
                continue
            where = panel.get("title")
            self.assertTrue(panel.get("targets"), f"{where} has no query")
            # No hard-coded data source: the dashboard must work in any Grafana.
            self.assertEqual(panel["datasource"], {"type": "prometheus", "uid": "${datasource}"}, where)
            position = panel["gridPos"]
            self.assertLessEqual(position["x"] + position["w"], 24, where)

    def test_panels_do_not_overlap(self):
        taken = set()
        for panel in all_panels(load_dashboard()):
            position = panel["gridPos"]
            cells = {(x, y) for x in range(position["x"], position["x"] + position["w"])
                     for y in range(position["y"], position["y"] + position["h"])}
            self.assertFalse(cells & taken, f"{panel.get('title')} overlaps another panel")
            taken |= cells

    def test_every_queried_metric_is_defined_in_metrics_rs(self):
        exported = exported_names()
        unknown = []
        for where, expression in queries(load_dashboard()):
            names = metric_names_in(expression)
            if not names:
                unknown.append(f"{where}: queries no metric: {expression}")
            for name in sorted(names):
                if name not in exported:
                    unknown.append(f"{where}: {name} is not exported by metrics.rs")
        self.assertEqual(unknown, [], "\nknown names: " + ", ".join(sorted(exported)))

    def test_every_label_is_recorded_somewhere(self):
        allowed = recorded_labels() | TARGET_LABELS | set(PENDING_LABELS)
        unknown = []
        for where, expression in queries(load_dashboard()):
            for label in sorted(labels_in(expression) - allowed):
                unknown.append(f"{where}: label {label!r} is set by no KeyValue::new in crates/")
        self.assertEqual(unknown, [])
        for label, why in PENDING_LABELS.items():
            if label in recorded_labels():
                self.fail(f"label {label!r} is recorded now: drop it from PENDING_LABELS")
            print(f"note: dashboard label {label!r} is not recorded yet: {why}", file=sys.stderr)

    def test_every_matched_label_value_exists_in_the_code(self):
        """kind="rate", outcome!~"succeeded|ignored", ...: a value the code
        never writes would make a panel silently show nothing."""
        literals = rust_string_literals()
        unknown = []
        for where, expression in queries(load_dashboard()):
            for label, value in matched_label_values(expression):
                if label in TARGET_LABELS:
                    continue
                if value not in literals:
                    unknown.append(f"{where}: {label}={value!r} is no string literal in crates/")
        self.assertEqual(unknown, [])

    def test_covers_the_required_metrics(self):
        used = set()
        for _, expression in queries(load_dashboard()):
            used |= metric_names_in(expression)
        families = {instrument.family(): instrument for instrument in defined_instruments()}
        missing = []
        for what, family in REQUIRED_FAMILIES.items():
            self.assertIn(family, sorted(families), f"{family} ({what}) is no longer defined in metrics.rs")
            if not families[family].exported() & used:
                missing.append(f"{what} ({family})")
        self.assertEqual(missing, [], "the dashboard lacks panels for these")


def main() -> int:
    verbosity = 2 if "-v" in sys.argv else 1
    result = unittest.TextTestRunner(verbosity=verbosity, stream=sys.stdout).run(
        unittest.TestLoader().loadTestsFromModule(sys.modules[__name__]))
    failed = len(result.failures) + len(result.errors)
    print(f"dashboard: {result.testsRun - failed} passed, {failed} failed")
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
