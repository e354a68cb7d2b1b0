#!/usr/bin/env bash
# Runs make targets one after another and times each: wall time, and CPU
# time (user + system, of everything the step ran). At the end it prints a
# table of the steps; when a step fails, the table of the steps so far and
# the one that failed, and exits with its status.
#   scripts/timed.sh STEP...      (`make test` runs its steps this way)
# A STEP of targets joined by `+` (build+python-tools) runs them side by
# side: the first in the foreground, the others with their output kept and
# printed when the group ends (a download waits on the network, a build on
# the CPU). Each target still gets a row of its own in the table, and the
# group one with its wall time.
set -uo pipefail
cd "$(dirname "$0")/.."
# The steps' own prerequisites (setup) are steps of their own here.
export SLUICE_TIMED_STEP=1

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Runs `make TARGET` in a subshell that then writes its wall seconds, the
# CPU seconds of everything it ran (the second line of `times`: its
# children) and make's status to $work/TARGET.
run_target() {
  local target=$1 started=$SECONDS status
  ${MAKE:-make} --no-print-directory "$target"
  status=$?
  # `times` in this shell (in a pipeline it would run in a subshell of
  # its own, with no children).
  times >"$work/$target.times"
  tail -1 "$work/$target.times" | awk -v wall=$((SECONDS - started)) -v status="$status" '{
    total = 0
    for (i = 1; i <= 2; i++) { split($i, part, "m"); sub("s", "", part[2]); total += part[1] * 60 + part[2] }
    printf "%d %.1f %d\n", wall, total, status
  }' >"$work/$target.time"
  return "$status"
}

names=() walls=() cpus=()
table() {
  local total_wall=0 total_cpu=0 i
  printf '\n==> time per step (wall clock; CPU = user + system of all it ran)\n'
  printf '    %-52s %8s %8s\n' step wall CPU
  for i in "${!names[@]}"; do
    printf '    %-52s %7ss %7ss\n' "${names[$i]}" "${walls[$i]}" "${cpus[$i]}"
    case "${names[$i]}" in
      "  "*) ;; # a target of a group: its group's row counts it
      *)
        total_wall=$((total_wall + walls[i]))
        total_cpu=$(awk -v a="$total_cpu" -v b="${cpus[$i]}" 'BEGIN { printf "%.1f", a + b }')
        ;;
    esac
  done
  printf '    %-52s %7ss %7ss\n' total "$total_wall" "$total_cpu"
}

for step in "$@"; do
  IFS=+ read -r -a targets <<<"$step"
  started=$SECONDS
  echo "==> make ${targets[*]}"
  pids=()
  for target in "${targets[@]:1}"; do
    (run_target "$target") >"$work/$target.log" 2>&1 &
    pids+=($!)
  done
  (run_target "${targets[0]}")
  failed=""
  for i in "${!targets[@]}"; do
    target=${targets[$i]}
    if [ "$i" -gt 0 ]; then
      wait "${pids[$((i - 1))]}"
      echo "==> output of make $target (ran beside ${targets[0]})"
      cat "$work/$target.log"
    fi
  done
  group_cpu=0
  for target in "${targets[@]}"; do
    read -r wall cpu status <"$work/$target.time" || { wall=0 cpu=0 status=1; }
    label=$target
    [ "${#targets[@]}" -gt 1 ] && label="  $target"
    [ "$status" -ne 0 ] && { label="$label (FAILED)"; failed=$status; }
    names+=("$label") walls+=("$wall") cpus+=("$cpu")
    group_cpu=$(awk -v a="$group_cpu" -v b="$cpu" 'BEGIN { printf "%.1f", a + b }')
  done
  if [ "${#targets[@]}" -gt 1 ]; then
    # The group's row goes before its targets' rows.
    last=$((${#names[@]} - ${#targets[@]}))
    names=("${names[@]:0:$last}" "${targets[*]} (side by side)" "${names[@]:$last}")
    walls=("${walls[@]:0:$last}" "$((SECONDS - started))" "${walls[@]:$last}")
    cpus=("${cpus[@]:0:$last}" "$group_cpu" "${cpus[@]:$last}")
  fi
  if [ -n "$failed" ]; then
    table
    exit "$failed"
  fi
done
table
