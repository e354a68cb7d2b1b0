#!/usr/bin/env bash
# Shows that the simulation finds bugs (issue 31, part 6): for each bug put
# back, one at a time, runs the seeds `make test` runs (SEEDS, 1000) and
# prints one JSON line naming the first seed that found it.
#
# Two kinds of bug:
#   - a core's bug: crates/sluice-sim/bugs/<name>.patch, applied to a
#     worktree of HEAD in /tmp (target dir under the cache), never to this
#     checkout; production code carries no bug switch.
#   - a bug of the modelled owner runtime, links or workers (the logic
#     lives in the simulation's model, not in a core): SIM_BUG=<name>,
#     listed in crates/sluice-sim/bugs/model-bugs.txt.
#
# Usage: scripts/sim-bugs.sh [name...]   (all when none is named)
# Exit status 1 when a bug was not found.
set -euo pipefail

root=$(git rev-parse --show-toplevel)
seeds=${SEEDS:-1000}
cache=${SIM_BUGS_CACHE:-$HOME/.cache/sluice}
target="$cache/target-sim-bugs"
worktree=${SIM_BUGS_WORKTREE:-/tmp/sluice-sim-bugs}
export CARGO_INCREMENTAL=0

wanted=("$@")
is_wanted() {
  [[ ${#wanted[@]} -eq 0 ]] && return 0
  local name
  for name in "${wanted[@]}"; do [[ $name == "$1" ]] && return 0; done
  return 1
}

# One worktree for every patch: a patch is applied, run and reverted, so
# only the crates it touches (and those above them) are built again.
if [[ ! -d $worktree ]]; then
  git -C "$root" worktree add --detach "$worktree" HEAD >/dev/null 2>&1
else
  git -C "$worktree" checkout --detach -q "$(git -C "$root" rev-parse HEAD)"
  git -C "$worktree" checkout -q -- .
fi

missed=0
# run_sim <bug> <kind> <dir> [env...]: one JSON line.
run_sim() {
  local bug=$1 kind=$2 dir=$3
  shift 3
  local line
  line=$(cd "$dir" && env "$@" SEEDS="$seeds" SIM_STOP_AT_FIRST=1 CARGO_TARGET_DIR="$target" \
    cargo run -q --locked -p sluice-sim --bin sluice-sim 2>/dev/null | tail -n 1 || true)
  if [[ -z $line ]]; then
    jq -cn --arg bug "$bug" --arg kind "$kind" '{bug: $bug, kind: $kind, found: false, error: "the simulation did not run (build failed?)"}'
    missed=1
    return
  fi
  jq -c --arg bug "$bug" --arg kind "$kind" \
    '{bug: $bug, kind: $kind, found: (.failures > 0), seed: .failed_seeds[0], seeds_run: .seeds_run, violation: .first_violation, seconds: .seconds}' <<<"$line"
  if [[ $(jq -r '.failures > 0' <<<"$line") != true ]]; then missed=1; fi
}

for patch in "$root"/crates/sluice-sim/bugs/*.patch; do
  bug=$(basename "$patch" .patch)
  is_wanted "$bug" || continue
  git -C "$worktree" apply "$patch"
  run_sim "$bug" patch "$worktree"
  git -C "$worktree" apply -R "$patch"
done

while read -r bug _; do
  [[ -z $bug || $bug == \#* ]] && continue
  is_wanted "$bug" || continue
  run_sim "$bug" model "$worktree" SIM_BUG="$bug"
done <"$root/crates/sluice-sim/bugs/model-bugs.txt"

exit $missed
