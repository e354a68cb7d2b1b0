# The contract README and CI both call. Every target installs what is missing
# and starts what must run (scripts/dev-env.sh), then does its job.

SHELL := /bin/bash
export CARGO_TARGET_DIR ?= $(HOME)/.cache/sluice/target
CARGO ?= cargo
NEXTEST := $(shell command -v cargo-nextest >/dev/null 2>&1 && echo yes)
# Inside `make test` (scripts/timed.sh) each step runs on its own, timed:
# the setup steps are steps of their own there, not prerequisites.
SETUP := $(if $(SLUICE_TIMED_STEP),,setup)
TEST_TOOLS := $(if $(SLUICE_TIMED_STEP),,setup python-tools browser-tools)

# One dev build serves `make run`, the tests and the short chaos run, built
# once. The same profile (dev), the same dependency features (--examples makes
# cargo resolve features with the dev-dependencies, as `cargo test
# --workspace` does, so the test build reuses every dependency) and the same
# compiler wrapper: scripts/lint-build.sh compiles the workspace's crates
# through clippy-driver, so compiling them is also linting them.
LINT_BUILD := scripts/lint-build.sh
BUILD_ARGS := --locked --workspace --exclude sluice-e2e --bins --examples

.PHONY: help setup python-tools browser-tools run build test test-build fmt-check long-functions clippy unit-and-integration helm-check bench bench-backlog chaos chaos-short fmt sim sim-bugs

help:
	@echo "make run         set up and run Sluice locally (all four services in one process)"
	@echo "make test        set up and run every check: fmt, clippy, unit and integration tests, helm-check, short chaos; prints the time of each step"
	@echo "make bench       run the benchmarks; the last line printed is one JSON object"
	@echo "make bench-backlog  a backlog of BACKLOG_JOBS (1,000,000) jobs, services as separate processes: enqueue and drain rates, memory per waiting job, serving again after kill -9; one JSON line"
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

# The service binaries, the CLI and the console (dev build, shared with the
# tests). Inside `make test` a warning fails the build (clippy's lints).
build: $(SETUP)
	$(LINT_BUILD) $(if $(SLUICE_TIMED_STEP),--deny-warnings) $(CARGO) build $(BUILD_ARGS)

# `make run` builds only the binary it starts: still the whole workspace
# selected with --examples, so cargo resolves the same features and every
# artifact is one `make build` and the tests reuse.
run: $(SETUP)
	$(LINT_BUILD) $(CARGO) build --locked --workspace --exclude sluice-e2e --bin sluice --examples
	@scripts/run-banner.sh
	$(CARGO_TARGET_DIR)/debug/sluice dev

fmt:
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

# No production function over 80 lines but flat lists (issue 31): at most 5.
long-functions:
	@python3 scripts/long-functions.py --max-count 5

# A check build of its own; `make test` lints in its build instead (build,
# test-build: scripts/lint-build.sh).
clippy: setup
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

# Every test binary, compiled and linted (no warning allowed), without running.
test-build: $(SETUP)
	$(LINT_BUILD) --deny-warnings $(CARGO) test --locked --workspace --no-run

# Against a fresh broker of their own (scripts/with-test-broker.sh).
unit-and-integration: $(TEST_TOOLS)
ifeq ($(NEXTEST),yes)
	scripts/with-test-broker.sh $(LINT_BUILD) $(CARGO) nextest run --locked --workspace --no-fail-fast
	$(LINT_BUILD) $(CARGO) test --locked --workspace --doc
else
	scripts/with-test-broker.sh $(LINT_BUILD) $(CARGO) test --locked --workspace --no-fail-fast
endif

helm-check:
	@bash scripts/helm-check.sh

# Each step timed (scripts/timed.sh); the table of times is printed at the
# end, or at the failing step. The builds come first, so a compile error or
# a lint fails fast, and the dev build `make run` uses is the first. Steps
# joined by `+` run side by side: the tools download while the build
# compiles, and the chart is checked while the tests (which mostly wait on
# the broker and PostgreSQL: about 0.8 of the 2 cores) run.
TEST_STEPS := setup fmt-check long-functions build+python-tools+browser-tools test-build unit-and-integration+helm-check chaos-short
test:
	@MAKE="$(MAKE)" scripts/timed.sh $(TEST_STEPS)
	@echo "make test: all checks passed"

# A short `make chaos` (the dev build, its own broker port): for each worker
# kind, 600 jobs on 10 keys while instances, workers, the broker and
# PostgreSQL fail (no run without faults: no throughput ratio).
chaos-short: $(SETUP)
	@CHAOS_PROFILE=debug CHAOS_JOBS=600 CHAOS_KEYS=10 CHAOS_RATE=15 CHAOS_DEADLINE_S=300 CHAOS_CLEAN=0 \
	  SLUICE_CHAOS_BROKER_PORT=19293 scripts/chaos.sh

# The deterministic simulation (crates/sluice-sim): SEEDS, SEED_FROM, SEED,
# SIM_BUG, SIM_TRACE, SIM_FAULTS_UNTIL_MS, SIM_JOBS from the environment or
# the command line. Built like the tests (the dev profile gives the
# simulation's own crate an opt-level: Cargo.toml).
sim:
	@$(LINT_BUILD) $(CARGO) run --locked -q -p sluice-sim --bin sluice-sim

sim-bugs:
	@scripts/sim-bugs.sh

bench: setup
	@scripts/bench.sh

chaos: setup
	@scripts/chaos.sh

# BACKLOG_JOBS, BACKLOG_KEYS, BACKLOG_LIMIT and the rest: see
# tests/src/bin/sluice-chaos/backlog.rs. A release build, its own broker.
bench-backlog: setup
	@scripts/chaos.sh backlog
