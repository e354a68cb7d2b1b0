#!/usr/bin/env bash
# Printed by `make run` before Sluice starts.
cat <<'TEXT'
==> Starting Sluice (all four services in one process). Endpoints follow.

    Try it from another terminal: 30 jobs on one key limited to 2 at a time,
    run by a worker that holds each job ~300 ms; watch them go through two by two:

      $HOME/.cache/sluice/target/release/sluice try --jobs 30 --limit 2

TEXT
