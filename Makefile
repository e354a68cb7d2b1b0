# The contract README and CI both call. Every target installs what is missing
# and starts what must run (scripts/dev-env.sh), then does its job.

SHELL := /bin/bash
export CARGO_TARGET_DIR ?= $(HOME)/.cache/sluice/target
CARGO ?= cargo
NEXTEST := $(shell command -v cargo-nextest >/dev/null 2>&1 && echo yes)

.PHONY: help setup python-tools browser-tools run build test fmt-check clippy unit-and-integration helm-check bench chaos chaos-short fmt sim sim-bugs

help:
	@echo "make run         set up and run Sluice locally (all four services in one process)"
	@echo "make test        set up and run every check: fmt, clippy, unit and integration tests, helm-check"
	@echo "make bench       run the benchmarks; the last line printed is one JSON object"
	@echo "make helm-check  lint, render and schema-validate the Helm chart"
	@echo "make sim         the deterministic simulation: SEEDS=N make sim runs N seeds (1000), SEED=n make sim replays one with its trace; one JSON line"
	@echo "make sim-bugs    put back known bugs one at a time; the seed of make test's that finds each (one JSON line per bug)"
	@echo "make chaos       kill -9 services and workers (separate processes) while jobs flow, for stream and Kafka workers, with and without faults; one JSON line per run, a summary last"

setup:
	@scripts/dev-env.sh all

# The Python worker example and the documented kcat and Python producer
# examples run in the tests (venv and kcat under $HOME/.cache/sluice/tools).
python-tools:
	@scripts/install-python-tools.sh >/dev/null

# The console's browser tests drive headless Chromium through chromedriver
# (Debian packages, installed when missing).
browser-tools:
	@scripts/dev-env.sh browser

build: setup
	$(CARGO) build --release --locked -p sluice-cli -p sluice-admission -p sluice-limit-grant -p sluice-rate-window -p sluice-refresh-dispatcher -p sluice-console

run: build
	@scripts/run-banner.sh
	$(CARGO_TARGET_DIR)/release/sluice dev

fmt:
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

clippy: setup
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

# Against a fresh broker of their own (scripts/with-test-broker.sh).
unit-and-integration: setup python-tools browser-tools
ifeq ($(NEXTEST),yes)
	scripts/with-test-broker.sh $(CARGO) nextest run --locked --workspace --no-fail-fast
	$(CARGO) test --locked --workspace --doc
else
	scripts/with-test-broker.sh $(CARGO) test --locked --workspace --no-fail-fast
endif

helm-check:
	@bash scripts/helm-check.sh

test: fmt-check clippy unit-and-integration helm-check chaos-short
	@echo "make test: all checks passed"

# A short `make chaos` (debug builds, its own broker port): for each worker
# kind, 600 jobs on 10 keys while instances, workers, the broker and
# PostgreSQL fail (no run without faults: no throughput ratio).
chaos-short: setup
	@CHAOS_PROFILE=debug CHAOS_JOBS=600 CHAOS_KEYS=10 CHAOS_RATE=15 CHAOS_DEADLINE_S=300 CHAOS_CLEAN=0 \
	  SLUICE_CHAOS_BROKER_PORT=19293 scripts/chaos.sh

# The deterministic simulation (crates/sluice-sim): SEEDS, SEED_FROM, SEED,
# SIM_BUG, SIM_TRACE, SIM_FAULTS_UNTIL_MS, SIM_JOBS from the environment or
# the command line. Built like the tests (the dev profile gives the
# simulation and the cores it drives an opt-level: Cargo.toml).
sim:
	@$(CARGO) run --locked -q -p sluice-sim --bin sluice-sim

sim-bugs:
	@scripts/sim-bugs.sh

bench: setup
	@scripts/bench.sh

chaos: setup
	@scripts/chaos.sh
