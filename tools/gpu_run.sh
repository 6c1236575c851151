#!/usr/bin/env bash
# The GPU steps behind the committed GPU results, run from a checkout on a CUDA machine (one host; NCCL where there
# are 2 GPUs). Steps run in the order given; a step that fails is logged and the next still runs (exit status 1 at
# the end). Each step writes its result file as soon as it exists, so a machine taken back mid-way loses only the step
# it was in, and the resumable ones (time, calibration, e2e-cp2-*) go on from their rows at the next call.
#
# Set-up, on every fresh machine (it keeps /tmp only while warm, so run these back to back; a run may carry at most
# 64 MiB of files, hence one part of Transformer Engine's wheel at a time, from `bash tools/te_to_device.sh fetch`):
#   bash tools/gpu_run.sh te-receive:1 setup            # with .tep1 and .whl/ beside the tree: wheels, the extension
#   bash tools/gpu_run.sh te-receive:2 ... te-receive:4 # with only .tepN beside the tree
#   bash tools/gpu_run.sh te-receive:5 te               # Transformer Engine 2.20.2's build (~2 min)
# One GPU (rows record the card; on a card above 80 GB, E2E_ARGS="--hbm-cap-gib 79.18" answers for an H100):
#   tests | tests:<pytest args>     tests/gpu                  suite        the whole CPU suite on this machine
#   tile-tests                      the tiled sublayer on TE, TE's bottom-right probe at a 16K tile against 1M keys,
#                                   what TE's attention backward holds under determinism (4K and 16K tokens), and
#                                   TE's attention as one call per K/V head against one call (16K tile, 1M keys)
#   reach-start, reach-collect      peakflat-auto at REACH_LENGTHS in the background (~20 min), then its rows
#   reach-local-start, reach-local-collect
#                                   the same on the local spec with the SDPA attention: needs no Transformer Engine,
#                                   so it can start in the set-up call (`setup 'tests:tests/gpu/test_tile_gpu.py
#                                   tests/gpu/test_attention_cp_gpu.py' reach-local-start`; each later call
#                                   re-sends the tree, so copy the rows to $OUT before the next) ->
#                                   bench/results/e2e_local_reach.json
#   time                            e2e 48K, 16K, 32K, 8K, megatron-te and peakflat-auto, 3 runs each, megatron-te in the
#                                   configuration its search rows name -> bench/results/e2e.json (rows time,...)
#   same-loss-fp32, same-loss-bf16  50 iterations at 8K: fp32 (TF32 off) on the local spec (TE's layers run fp32
#                                   through their unfused backend, whose [s, s] tensors do not fit), and bf16 at lr 1e-5
#                                   -> bench/results/e2e_local_same_loss.json (fp32; a results file keeps one spec) and
#                                   bench/results/e2e.json (bf16). same-loss-fp32 needs no Transformer Engine: it can run
#                                   in the set-up call (`te-receive:1 setup same-loss-fp32`)
#   calibration                     bench/planner_calibration.py for BUDGET seconds
#   example, demo, mtp-release, e2e[:args], bench-<component>[:args]
# Two GPUs of one host:
#   cp-tests                        tests/gpu/test_cp_gpu.py and test_tile_cp_gpu.py
#   vocab-tp2                       bench/vocab.py at TP 2 -> bench/results/vocab.json (rows tp=2, gpus 2)
#   e2e-cp2-reach, e2e-cp2-time     bench/e2e.py --cp 2 -> bench/results/e2e_cp2.json
#   time-long                       peakflat-auto's time per iteration at 384K and 512K, 3 runs each -> bench/results/e2e.json
# Output: stdout, docs/evidence/gpu_<step>.log, and $OUT/ when set (with results/, the result files after each step).
# KEEP=<dir>: the result files survive a fresh copy of the tree on the same machine: restored from <dir> at the start
# (they are the newer), saved there after each step, so that a resumable step goes on across invocations.
# Environment: PEAKFLAT_COMMIT (the commit the rows name, where the tree here is a copy whose git metadata is another
# commit's: pass the commit the copy was made from), PYTHON (python3), BUDGET (seconds a
# resumable step may run, default 540), E2E_ARGS (added to every bench/e2e.py step), REACH_LENGTHS (the reach steps'
# lengths, default 256K,512K,1M; a length that already has a row in the results file is not run again, so pass
# E2E_ARGS="--out <new file>" to measure it anew). Wheels missing on the machine
# (megatron-core, liger-kernel, cut-cross-entropy) come from .whl/ (../shared/tools/device-wheels.sh beforehand).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-540}
EVIDENCE=docs/evidence
mkdir -p "$EVIDENCE" bench/results
status=0
if [[ -n "${KEEP:-}" && -d "$KEEP/results" ]]; then
  cp "$KEEP"/results/*.json bench/results/ 2>/dev/null && echo "=== results restored from $KEEP/results"
fi
save_results() {
  local d
  for d in ${KEEP:+"$KEEP/results"} ${OUT:+"$OUT/results"}; do
    mkdir -p "$d" && cp bench/results/*.json "$d/"
  done
}
step() {  # name, command...
  local name=$1; shift
  local log=$EVIDENCE/gpu_$name.log
  echo "=== [$(date +%T)] $name: $*" | tee "$log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
  [[ -n "${OUT:-}" ]] && cp "$log" "$OUT/"
  save_results
  [[ $rc -eq 0 ]] || status=1
}
e2e() { step "$1" $PY bench/e2e.py "${@:2}" ${E2E_ARGS:-}; }
REACH=(--phases reach --methods peakflat-auto --lengths "${REACH_LENGTHS:-256K,512K,1M}" --timeout 1500 --background)
for s in "$@"; do
  case "$s" in
    te-receive:*) step "te_receive_${s#te-receive:}" bash tools/te_to_device.sh receive "${s#te-receive:}" ;;
    te) step te bash tools/te_to_device.sh build ;;
    setup)
      shopt -s nullglob; wheels=(.whl/*.whl); shopt -u nullglob
      (( ${#wheels[@]} )) && step wheels $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}"
      step build_ext $PY setup.py -q build_ext --inplace
      step env $PY -c "import torch, megatron.core, triton; import megatron_peakflat._C as C; n = torch.cuda.device_count(); print('torch', torch.__version__, 'mcore', megatron.core.__version__, 'triton', triton.__version__, 'gpus', n, [torch.cuda.get_device_name(i) for i in range(n)], 'ext', C.__file__)"
      ;;
    tests) step tests $PY -m pytest tests/gpu -q -ra -p no:cacheprovider ;;
    tests:*) step tests $PY -m pytest ${s#tests:} -q -ra -p no:cacheprovider ;;
    suite) step suite env PYTHON=$PY bash tools/gpu_full_suite.sh ;;
    tile-tests)
      step tile_tests $PY -m pytest tests/gpu/test_tile_gpu.py -v -rA -p no:cacheprovider
      step te_bottom_right $PY tools/probes/te_bottom_right.py 16384 1048576
      step te_deterministic_workspace $PY tools/probes/te_deterministic_workspace.py 4096 16384
      step te_kv_head_calls $PY tools/probes/te_kv_head_calls.py 16384 1048576 ;;
    reach-start) e2e reach_start "${REACH[@]}" ;;
    reach-collect) step reach_collect $PY bench/e2e.py --collect ;;
    reach-local-start) e2e reach_local_start --spec local "${REACH[@]}" --out e2e_local_reach.json ;;
    reach-local-collect) step reach_local_collect $PY bench/e2e.py --collect --out e2e_local_reach.json ;;
    time) e2e time --phases time,summary --methods megatron-te,peakflat-auto --repeats 3 --timeout 300 --budget "$BUDGET" \
            --time-seqs 48K,16K,32K,8K ;;
    time-long) e2e time_long --phases time --methods peakflat-auto --repeats 3 --time-iters 2 --timeout 420 \
                 --budget "$BUDGET" --time-seqs 384K,512K ;;
    same-loss-fp32) e2e same_loss_fp32 --phases same-loss --dtype fp32 --spec local --same-loss-seq 8K --same-loss-iters 50 \
                      --out e2e_local_same_loss.json --budget "$BUDGET" ;;
    same-loss-bf16) e2e same_loss_bf16 --phases same-loss --lr 1e-5 --same-loss-seq 8K --same-loss-iters 50 --budget "$BUDGET" ;;
    calibration) step calibration $PY bench/planner_calibration.py --max-minutes $(( BUDGET / 60 )) ;;
    example)
      for pf in off on; do
        step "example_$pf" env PEAKFLAT=$pf TRAIN_ITERS=${TRAIN_ITERS:-20} MASTER_PORT=$((29600 + RANDOM % 100)) bash examples/pretrain_moe.sh
      done ;;
    demo) step demo $PY -m megatron_peakflat.demo ;;
    mtp-release)
      step mtp_release $PY bench/pretrain_compare.py --timeout 150 --out pretrain_mtp_32k_release.json \
        --env "NUM_LAYERS=2,HIDDEN=2048,HEADS=16,FFN=5632,MOE_FFN=1408,EXPERTS=8,TOPK=2,VOCAB=201088,SEQ_LEN=32768,GLOBAL_BATCH=1,TRAIN_ITERS=4,CHUNK_CAP=auto" \
        --run "vocab:PEAKFLAT=on;PEAKFLAT_COMPONENTS=vocab" -- --deterministic-mode --mtp-num-layers 1
      step planner_mtp $PY bench/planner_mtp.py ;;
    e2e) e2e e2e ;;
    e2e:*) e2e e2e ${s#e2e:} ;;
    bench-*)
      spec=${s#bench-}; name=${spec%%:*}; args=""
      [[ "$spec" == *:* ]] && args=${spec#*:}
      step "bench_$name" $PY bench/$name.py $args ;;
    cp-tests) step cp_tests $PY -m pytest tests/gpu/test_cp_gpu.py tests/gpu/test_tile_cp_gpu.py -v -rA -p no:cacheprovider ;;
    vocab-tp2)
      step vocab_tp2 $PY -m torch.distributed.run --nproc-per-node 2 --master-port $((29600 + RANDOM % 100)) bench/vocab.py \
        --cases 32768x7168x201088 --repeats 3 \
        --methods peakflat-gather,peakflat-activations,peakflat-weights,megatron-native-ce,megatron-fused-ce ;;
    e2e-cp2-reach) e2e e2e_cp2_reach --cp 2 --phases reach,summary --methods megatron-te,peakflat-auto --budget "$BUDGET" ;;
    e2e-cp2-time) e2e e2e_cp2_time --cp 2 --phases time --methods megatron-te,peakflat-auto --repeats 3 --budget "$BUDGET" ;;
    *) echo "unknown step $s: see the head of $0"; status=1 ;;
  esac
done
exit $status
