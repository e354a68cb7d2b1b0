#!/usr/bin/env bash
# Runs make targets one after another and times each: wall time, and CPU
# time (user + system, of everything the step ran). At the end it prints a
# table of the steps; when a step fails, the table of the steps so far and
# the one that failed, and exits with its status.
#   scripts/timed.sh TARGET...      (`make test` runs its steps this way)
set -uo pipefail
cd "$(dirname "$0")/.."
# The steps' own prerequisites (setup) are steps of their own here.
export SLUICE_TIMED_STEP=1

# cpu = CPU seconds used so far by finished children: the second line of
# `times`, run in this shell (in a subshell it would count only its own).
times_file="$(mktemp)"
trap 'rm -f "$times_file"' EXIT
children_cpu() {
  times >"$times_file"
  cpu=$(tail -1 "$times_file" | awk '{
    total = 0
    for (i = 1; i <= 2; i++) { split($i, part, "m"); sub("s", "", part[2]); total += part[1] * 60 + part[2] }
    printf "%.1f", total
  }')
}

names=() walls=() cpus=()
table() {
  local total_wall=0 total_cpu=0 i
  printf '\n==> time per step (wall clock; CPU = user + system of all it ran)\n'
  printf '    %-32s %8s %8s\n' step wall CPU
  for i in "${!names[@]}"; do
    printf '    %-32s %7ss %7ss\n' "${names[$i]}" "${walls[$i]}" "${cpus[$i]}"
    total_wall=$((total_wall + walls[i]))
    total_cpu=$(awk -v a="$total_cpu" -v b="${cpus[$i]}" 'BEGIN { printf "%.1f", a + b }')
  done
  printf '    %-32s %7ss %7ss\n' total "$total_wall" "$total_cpu"
}

for step in "$@"; do
  started=$SECONDS
  children_cpu
  cpu_before=$cpu
  echo "==> make $step"
  ${MAKE:-make} --no-print-directory "$step"
  status=$?
  names+=("$step")
  walls+=($((SECONDS - started)))
  children_cpu
  cpus+=("$(awk -v a="$cpu" -v b="$cpu_before" 'BEGIN { printf "%.1f", a - b }')")
  if [ "$status" -ne 0 ]; then
    names[${#names[@]}-1]="$step (FAILED)"
    table
    exit "$status"
  fi
done
table
