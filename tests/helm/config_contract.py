"""The Sluice configuration file against the Rust structs that read it.

crates/sluice-common/src/config.rs declares the configuration as
`#[serde(deny_unknown_fields)]` structs: a key the code does not have makes
a service refuse to start. These helpers read those structs (one field per
line, `pub name: Type,`) and check a parsed TOML file against them. Used by
test_chart.py (the chart's rendered sluice.toml) and test_deploy.py
(deploy/sluice.compose.toml). Standard library only.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_RS = ROOT / "crates" / "sluice-common" / "src" / "config.rs"
# config.rs and its submodules (the section structs live in config/sections.rs).
CONFIG_SOURCES = [CONFIG_RS, *sorted((CONFIG_RS.parent / "config").glob("*.rs"))]
DEFAULT_TOML = ROOT / "crates" / "sluice-common" / "src" / "default.toml"


@lru_cache(maxsize=None)
def rust_config_structs() -> dict:
    """The `#[serde(deny_unknown_fields)]` structs of config.rs and its
    submodules: name ->
    {field: (rust type, has a serde default)}. Fields are one per line there
    (`pub name: Type,`), so a line-based read is enough."""
    structs: dict[str, dict[str, tuple[str, bool]]] = {}
    current = None
    pending_default = False
    lines = [line for source in CONFIG_SOURCES for line in source.read_text().splitlines()]
    for line in lines:
        stripped = line.strip()
        opened = re.match(r"pub struct (\w+) \{$", stripped)
        if opened:
            current = structs.setdefault(opened.group(1), {})
            pending_default = False
            continue
        if current is None:
            continue
        if stripped == "}":
            current = None
            continue
        if stripped.startswith("#[serde(") and re.search(r"\bdefault\b", stripped):
            pending_default = True
            continue
        field = re.match(r"pub (\w+): (.+),$", stripped)
        if field:
            current[field.group(1)] = (field.group(2).strip(), pending_default)
            pending_default = False
    return structs


def config_contract_errors(config: dict, type_name: str = "SluiceConfig", path: str = "") -> list[str]:
    """Every key the file sets must be a field the Rust type has (the services
    refuse unknown keys at startup), with a value of a fitting TOML type."""
    structs = rust_config_structs()
    errors: list[str] = []

    def check(value, rust_type: str, where: str) -> None:
        rust_type = rust_type.strip()
        optional = re.fullmatch(r"Option<(.+)>", rust_type)
        if optional:
            check(value, optional.group(1), where)
            return
        vector = re.fullmatch(r"Vec<(.+)>", rust_type)
        if vector:
            if not isinstance(value, list):
                errors.append(f"{where}: expected a list for {rust_type}, got {value!r}")
                return
            for index, item in enumerate(value):
                check(item, vector.group(1), f"{where}[{index}]")
            return
        mapping = re.fullmatch(r"BTreeMap<String,\s*(.+)>", rust_type)
        if mapping:
            if not isinstance(value, dict):
                errors.append(f"{where}: expected a table for {rust_type}")
                return
            for key, item in value.items():
                check(item, mapping.group(1), f"{where}.{key}")
            return
        if rust_type in structs:
            if not isinstance(value, dict):
                errors.append(f"{where}: expected a table for {rust_type}")
                return
            fields = structs[rust_type]
            for key, item in value.items():
                if key not in fields:
                    errors.append(f"{where}.{key}: {rust_type} has no field {key!r} "
                                  "(deny_unknown_fields: the services would refuse to start)")
                    continue
                check(item, fields[key][0], f"{where}.{key}".lstrip("."))
            return
        integers = {"u8", "u16", "u32", "u64", "usize", "i8", "i16", "i32", "i64", "isize"}
        if rust_type in integers:
            if not isinstance(value, int) or isinstance(value, bool):
                errors.append(f"{where}: expected an integer ({rust_type}), got {value!r}")
            elif value < 0 and rust_type.startswith("u"):
                errors.append(f"{where}: {rust_type} cannot be negative")
        elif rust_type in ("f32", "f64"):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                errors.append(f"{where}: expected a number ({rust_type}), got {value!r}")
        elif rust_type == "bool":
            if not isinstance(value, bool):
                errors.append(f"{where}: expected a boolean, got {value!r}")
        elif rust_type in ("String", "Secret", "HumanDuration"):
            if not isinstance(value, str):
                errors.append(f"{where}: expected a string ({rust_type}), got {value!r}")
            elif rust_type == "HumanDuration" and not re.fullmatch(
                    r"\s*([0-9]+(\.[0-9]+)?\s*[a-zA-Zµ]+\s*)+", value):
                errors.append(f"{where}: {value!r} is not a duration")
        elif rust_type == "LogFormat":
            if value not in ("text", "json"):
                errors.append(f"{where}: log format {value!r}")
        elif rust_type == "CapScope":
            if value not in ("tenant", "global"):
                errors.append(f"{where}: cap scope {value!r}")
        else:
            errors.append(f"{where}: the test does not know Rust type {rust_type} (teach it)")

    check(config, type_name, path)
    return errors


def deep_merge(base: dict, overlay: dict) -> dict:
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def missing_required_fields(config: dict, type_name: str = "SluiceConfig", path: str = "") -> list[str]:
    """Fields without a serde default that the layered configuration
    (default.toml, then the file) leaves unset."""
    structs = rust_config_structs()
    missing = []
    for field, (rust_type, has_default) in structs[type_name].items():
        where = f"{path}.{field}".lstrip(".")
        if field not in config:
            if not has_default and not rust_type.startswith("Option<"):
                missing.append(where)
            continue
        value = config[field]
        if rust_type in structs and isinstance(value, dict):
            missing += missing_required_fields(value, rust_type, where)
        mapping = re.fullmatch(r"BTreeMap<String,\s*(\w+)>", rust_type)
        if mapping and mapping.group(1) in structs and isinstance(value, dict):
            for key, item in value.items():
                missing += missing_required_fields(item, mapping.group(1), f"{where}.{key}")
    return missing
