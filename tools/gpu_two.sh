#!/usr/bin/env bash
# The two-GPU runs (2 GPUs of one host, NCCL), step by step; each step writes its result file as soon as it exists:
#   bash tools/gpu_two.sh te-receive 1 ... te-receive 4      # one run per part, each with only .tepN beside the tree
#   bash tools/gpu_two.sh te-receive 5 setup te              # the last part, the wheels (.whl/), the extension, TE
#   bash tools/gpu_two.sh tests                              # tests/gpu/test_cp_gpu.py -> docs/evidence/two_gpu_tests.log
#   bash tools/gpu_two.sh vocab                              # TP 2 -> bench/results/vocab.json (rows tp=2, gpus 2)
#   bash tools/gpu_two.sh e2e-reach                          # CP 2 -> bench/results/e2e_cp2.json (row by row;
#   bash tools/gpu_two.sh e2e-time                           #   again to resume where --budget stopped it)
# Steps run in the order given; a step that fails is logged and the next still runs (exit status 1 at the end).
# Every step's output goes to docs/evidence/two_gpu_<step>.log (and $OUT when set). Environment: PYTHON (python3),
# BUDGET (seconds one e2e invocation may run, default 540), E2E_ARGS (added to both e2e steps).
# Before the wheels: .whl/ holds megatron-core and the peers (downloaded beforehand); TE's parts come from
# `bash tools/te_to_device.sh fetch` on a machine with network access.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
EVIDENCE=docs/evidence
mkdir -p "$EVIDENCE" bench/results
status=0
step() {  # name, command...
  local name=$1; shift
  local log=$EVIDENCE/two_gpu_$name.log
  echo "=== [$(date +%T)] $name: $*" | tee "$log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
  [[ -n "${OUT:-}" ]] && cp "$log" "$OUT/"
  [[ $rc -eq 0 ]] || status=1
}
while (( $# )); do
  s=$1; shift
  case "$s" in
    te-receive) n=${1:?te-receive N}; shift; step "te_receive_$n" bash tools/te_to_device.sh receive "$n" ;;
    setup)
      shopt -s nullglob; wheels=(.whl/*.whl); shopt -u nullglob
      (( ${#wheels[@]} )) && step wheels $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}"
      step build_ext $PY setup.py -q build_ext --inplace
      step env $PY -c "import torch, megatron.core; import megatron_peakflat._C; n = torch.cuda.device_count(); print('torch', torch.__version__, 'mcore', megatron.core.__version__, 'gpus', n, [torch.cuda.get_device_name(i) for i in range(n)]); assert n >= 2, 'these runs need 2 GPUs of one host'" ;;
    te) step te bash tools/te_to_device.sh build ;;
    tests) step tests $PY -m pytest tests/gpu/test_cp_gpu.py -v -rA -p no:cacheprovider ;;
    vocab)
      step vocab $PY -m torch.distributed.run --nproc-per-node 2 --master-port $((29600 + RANDOM % 100)) bench/vocab.py \
        --cases 32768x7168x201088 --repeats 3 \
        --methods peakflat-gather,peakflat-activations,peakflat-weights,megatron-native-ce,megatron-fused-ce ;;
    e2e-reach)
      step e2e_reach $PY bench/e2e.py --cp 2 --phases reach,summary --methods megatron-te,peakflat-auto \
        --budget "${BUDGET:-540}" ${E2E_ARGS:-} ;;
    e2e-time)
      step e2e_time $PY bench/e2e.py --cp 2 --phases time --methods megatron-te,peakflat-auto --repeats 3 \
        --budget "${BUDGET:-540}" ${E2E_ARGS:-} ;;
    *) echo "unknown step $s (te-receive N, setup, te, tests, vocab, e2e-reach, e2e-time)"; status=1 ;;
  esac
done
exit $status
