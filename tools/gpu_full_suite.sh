#!/usr/bin/env bash
# The test suite as `make test` runs it (tests/, tests/gpu included) on a machine with GPUs, in parallel
# pytest processes, JOBS at a time (the slowest first), so that it fits one time-limited run.
# Run after `tools/gpu_run.sh setup` has put the wheels on PYTHONPATH and built the extension.
#   bash tools/gpu_full_suite.sh                       # every test: the slow files one process per test function
#   bash tools/gpu_full_suite.sh tests/test_pretrain.py tests/test_vocab_ep_shard.py
#   bash tools/gpu_full_suite.sh "tests/test_pretrain.py -k resume" "tests/test_x.py::test_y"
# Each argument is one pytest process: a file, node ids, or either with pytest options after them.
# Environment: JOBS (default 8), LIMIT seconds per process (default 540), END (a time in epoch seconds:
# no process runs past it, and one that would start with under 20 s left does not start), OUT (logs go
# to $OUT/suite, and $OUT/suite.tgz).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
dest=${OUT:-/tmp}/suite
mkdir -p "$dest"
PY=${PYTHON:-python3}
if (( $# )); then
  procs=("$@")
else
  # The dry-run-heavy files set the wall time: one process per test function (its parametrisations
  # together), found in one collection; then every other file, tests/gpu's too, whole (slowest first).
  slow=(tests/test_pretrain.py tests/test_vocab_ep_shard.py tests/test_dispatch_megatron.py tests/gpu/test_resume_gpu.py)
  mapfile -t procs < <("$PY" -m pytest --collect-only -q -p no:cacheprovider "${slow[@]}" 2>/dev/null |
                       grep '::' | sed 's/\[.*$//' | awk '!seen[$0]++')
  (( ${#procs[@]} )) || { echo "collecting ${slow[*]} found no tests"; exit 1; }
  for f in tests/test_resume_check.py tests/test_dispatch.py tests/test_example_script.py tests/gpu/test_*.py \
           tests/test_*.py; do [[ " ${slow[*]} ${procs[*]} " == *" $f "* ]] || procs+=("$f"); done
fi
run_one() {  # one process's arguments
  local name; name=$(printf '%s' "$1" | tr -c 'A-Za-z0-9_-' '_' | cut -c1-120)
  local args; read -r -a args <<< "$1"
  local limit=${LIMIT:-540}
  if [[ -n "${END:-}" ]]; then
    local left=$(( END - $(date +%s) ))
    if (( left < 20 )); then echo "=== not started (no time left): $1"; return 1; fi
    (( left < limit )) && limit=$left
  fi
  timeout "$limit" "$PY" -m pytest -q -ra -p no:cacheprovider --durations=5 "${args[@]}" > "$dest/$name.log" 2>&1
  local rc=$?
  local summary; summary=$(grep -E '[0-9]+ (passed|failed|skipped|error)|no tests ran' "$dest/$name.log" | tail -n 1)
  echo "=== rc=$rc $1: ${summary:-$(tail -n 1 "$dest/$name.log")}"
  return $rc
}
export -f run_one
export PY dest LIMIT END
echo "=== ${#procs[@]} pytest processes, ${JOBS:-8} at a time"
printf '%s\n' "${procs[@]}" | xargs -P "${JOBS:-8}" -I{} bash -c 'run_one "$@"' _ {}
status=$?
tar czf "$dest.tgz" -C "$(dirname "$dest")" "$(basename "$dest")"  # one file to copy back from the machine
exit $(( status != 0 ))
