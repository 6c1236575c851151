#!/usr/bin/env bash
# The test suite as `make test` runs it (tests/, tests/gpu included) on a machine with GPUs, one pytest
# process per test file, JOBS files at a time (the slowest files first), so that it fits device calls.
# Run after `tools/gpu_run.sh setup` has put the wheels on PYTHONPATH and built the extension.
#   bash tools/gpu_full_suite.sh                       # every test file
#   bash tools/gpu_full_suite.sh tests/test_pretrain.py tests/test_vocab_ep_shard.py
#   bash tools/gpu_full_suite.sh "tests/test_pretrain.py -k resume" "tests/test_x.py::test_y[2]"
# Each argument is one pytest process: a file, a node id, or either with pytest options after it.
# Environment: JOBS (default 8), LIMIT seconds per file (default 540), OUT (logs go to $OUT/suite).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
dest=${OUT:-/tmp}/suite
mkdir -p "$dest"
PY=${PYTHON:-python3}
if (( $# )); then
  files=("$@")
else
  # The dry-run-heavy files first: they set the wall time.
  slow=(tests/test_pretrain.py tests/test_vocab_ep_shard.py tests/gpu tests/test_resume_check.py
        tests/test_dispatch_megatron.py tests/test_dispatch.py tests/test_example_script.py)
  files=("${slow[@]}")
  for f in tests/test_*.py; do [[ " ${slow[*]} " == *" $f "* ]] || files+=("$f"); done
fi
run_one() {  # file
  local name; name=$(printf '%s' "$1" | tr -c 'A-Za-z0-9_-' '_' | cut -c1-120)
  local args; read -r -a args <<< "$1"  # a file or node id, then any pytest options
  timeout "${LIMIT:-540}" "$PY" -m pytest -q -ra -p no:cacheprovider --durations=5 "${args[@]}" > "$dest/$name.log" 2>&1
  local rc=$?
  echo "=== rc=$rc $1: $(tail -n 1 "$dest/$name.log")"
  return $rc
}
export -f run_one
export PY dest LIMIT
printf '%s\n' "${files[@]}" | xargs -P "${JOBS:-8}" -I{} bash -c 'run_one "$@"' _ {}
status=$?
tar czf "$dest.tgz" -C "$(dirname "$dest")" "$(basename "$dest")"  # one file back from a device call
exit $(( status != 0 ))
