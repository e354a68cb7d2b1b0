#!/usr/bin/env bash
# Printed by `make run` before Sluice starts.
cat <<'TEXT'
==> Starting Sluice (all four services in one process). Once every partition
    is owned, it prints its endpoints and a command to try from another terminal.

TEXT
