#!/usr/bin/env bash
# Run GPU steps on a CUDA machine from a checkout of this repository (the commands behind the
# committed GPU results). Steps: setup, tests (or tests:<pytest args>), suite (the whole suite, tools/gpu_full_suite.sh), example, demo,
# mtp-release (the MTP run of pretrain_mtp_32k.json again, with moe-release, against the planner),
# e2e[:args] (bench/e2e.py; with TE from tools/te_to_device.sh on the PYTHONPATH),
# bench-<component>[:args].
#   bash tools/gpu_run.sh setup tests example bench-vocab bench-sco
# Wheels missing on the machine (megatron-core, liger-kernel, cut-cross-entropy) are taken from .whl/
# when present (downloaded beforehand on a machine with network access). Output goes to stdout and, when $OUT
# is set, to $OUT/gpu_run.log; benchmark JSON lands in bench/results/ (and $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG=${OUT:+$OUT/gpu_run.log}
LOG=${LOG:-/dev/null}
PY=${PYTHON:-python3}
status=0
step() {  # name, command...
  local name=$1; shift
  echo "=== [$(date +%T)] $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  [[ $rc -eq 0 ]] || status=1
}
for s in "$@"; do
  case "$s" in
    setup)
      if [[ -d .whl ]]; then
        step wheels $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
      fi
      step build-ext $PY setup.py -q build_ext --inplace
      export PYTHONPATH=$PWD:${PYTHONPATH:-}
      step env $PY -c "import torch, megatron.core, triton; import megatron_peakflat._C as C; print('torch', torch.__version__, 'mcore', megatron.core.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count(), 'ext', C.__file__)"
      ;;
    tests) step gpu-tests $PY -m pytest tests/gpu -q -ra -p no:cacheprovider ;;
    tests:*) step gpu-tests $PY -m pytest ${s#tests:} -q -ra -p no:cacheprovider ;;
    suite) step suite env PYTHON=$PY bash tools/gpu_full_suite.sh ;;
    example)
      for pf in off on; do
        step "example-$pf" env PEAKFLAT=$pf TRAIN_ITERS=${TRAIN_ITERS:-20} MASTER_PORT=$((29600 + RANDOM % 100)) bash examples/pretrain_moe.sh
      done ;;
    demo) step demo $PY -m megatron_peakflat.demo ;;
    mtp-release)
      step mtp-release $PY bench/pretrain_compare.py --timeout 150 --out pretrain_mtp_32k_release.json \
        --env "NUM_LAYERS=2,HIDDEN=2048,HEADS=16,FFN=5632,MOE_FFN=1408,EXPERTS=8,TOPK=2,VOCAB=201088,SEQ_LEN=32768,GLOBAL_BATCH=1,TRAIN_ITERS=4,CHUNK_CAP=auto" \
        --run "vocab:PEAKFLAT=on;PEAKFLAT_COMPONENTS=vocab" -- --deterministic-mode --mtp-num-layers 1
      step planner-mtp $PY bench/planner_mtp.py ;;
    e2e|e2e:*)
      args=""; [[ "$s" == e2e:* ]] && args=${s#e2e:}
      step e2e $PY bench/e2e.py $args ;;
    bench-*)
      spec=${s#bench-}; name=${spec%%:*}; args=""
      [[ "$spec" == *:* ]] && args=${spec#*:}
      step "bench-$name" $PY bench/$name.py $args ;;
    *) echo "unknown step $s" | tee -a "$LOG"; status=1 ;;
  esac
done
exit $status
