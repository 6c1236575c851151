#!/usr/bin/env bash
# Train a small MoE GPT with Megatron-Core, peakflat off or on. Mock data unless DATA_PATH is set.
#
#   examples/pretrain_moe.sh            # PEAKFLAT=auto (default): --peakflat auto, the planner's components
#   PEAKFLAT=on examples/pretrain_moe.sh   # every component (PEAKFLAT_COMPONENTS picks)
#   PEAKFLAT=off examples/pretrain_moe.sh  # Megatron alone
#   sbatch examples/pretrain_moe.sh     # under SLURM: one srun task per node, torchrun per node
#   sbatch --nodes 4 /abs/path/to/examples/pretrain_moe.sh   # from any directory
#   CONTAINER_IMAGE=/images/pytorch-megatron.sqsh sbatch examples/pretrain_moe.sh   # in a container (pyxis)
#   SAVE_DIR=/ckpt/run1 TB_DIR=/tb/run1 examples/pretrain_moe.sh   # checkpoints (resumed from), TensorBoard
#   examples/pretrain_moe.sh --seq-length 8192 --lr 1e-4   # extra flags go to Megatron, last, so they win
#
# Environment (defaults in brackets): GPUS_PER_NODE [Slurm's GPUs on the node, else nvidia-smi's, else torch's], NUM_LAYERS [4], HIDDEN [1024],
# HEADS [8], FFN [2816], MOE_FFN [704], EXPERTS [8], TOPK [2], EP [the largest size that divides both EXPERTS and the data-parallel ranks],
# TP [1], SEQ_LEN [4096], MICRO_BATCH [1], GLOBAL_BATCH [8, or MICRO_BATCH x data-parallel ranks when more], TRAIN_ITERS [20], VOCAB [32768], UNTIE [1] (0: output
# layer tied to the embedding), GROUPED_GEMM [auto: 1 when Transformer Engine imports, adding --moe-grouped-gemm; 0],
# PEAKFLAT [auto: start-up runs the planner on this command line and turns on what it recommends; on; off],
# PEAKFLAT_COMPONENTS [with PEAKFLAT=on: dispatch,vocab,sco,optimizer; vocab-ep in place of vocab also shards the
# output layer over the EP group; sco and optimizer cost PCIe time every step, so take only the components that
# `python -m megatron_peakflat.plan --megatron-args "..."` recommends, which is what auto does], CHUNK_CAP [4096, so that this small model chunks;
# auto: 8192 x TOPK pairs, at least 32768], DATA_PATH,
# TOKENIZER_MODEL, PYTHON [python3],
# MEGATRON_ARGS [none: more Megatron flags, split on spaces, e.g. "--optimizer-cpu-offload --use-precision-aware-optimizer"].
# Checkpoints and logs: SAVE_DIR [none: --save, with --save-interval SAVE_INTERVAL [1000]], LOAD_DIR [SAVE_DIR when
# set: --load, so a resubmitted job resumes; Megatron starts fresh where it finds no checkpoint], TB_DIR [none:
# --tensorboard-dir].
# SLURM: one task per node runs torchrun for its node. The tasks run the submitted script, found from its absolute
# path, `scontrol show job` or SLURM_SUBMIT_DIR, so sbatch works from any directory; PEAKFLAT_SCRIPT
# [/abs/path/examples/pretrain_moe.sh] overrides. Container (pyxis/enroot): CONTAINER_IMAGE [none: an image for
# srun --container-image: a registry image or a .sqsh file, e.g. an NGC PyTorch image with megatron-core installed;
# and peakflat is imported from this repository, mounted at its own path and put on PYTHONPATH], CONTAINER_MOUNTS
# [none: more src:dst mounts, comma-separated; the repository, DATA_PATH's, SAVE_DIR's, LOAD_DIR's and TB_DIR's
# directories are mounted already].
#
#SBATCH --job-name=peakflat-moe
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=peakflat-moe-%j.out
# Placeholders: set your job's time limit; to pick a partition, delete one '#' of the next-but-one line and name it.
#SBATCH --time=01:00:00
##SBATCH --partition=your-partition
set -euo pipefail

PYTHON=${PYTHON:-python3}
# The GPUs of this node, without importing torch where the batch host lacks it (a container job's tasks count again)
count_gpus() {
  if [[ "${SLURM_GPUS_ON_NODE:-}" =~ ^[1-9][0-9]*$ ]]; then echo "$SLURM_GPUS_ON_NODE"; return; fi
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
  if [[ "$n" -gt 0 ]]; then echo "$n"; return; fi
  "$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1
}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(count_gpus)}
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || { echo "GPUS_PER_NODE must be a positive integer, not '$GPUS_PER_NODE'" >&2; exit 2; }
MODEL_GIVEN="${HIDDEN:-}${SEQ_LEN:-}${EXPERTS:-}${TOPK:-}${MICRO_BATCH:-}${NUM_LAYERS:-}${MOE_FFN:-}"
NNODES=${SLURM_NNODES:-${NNODES:-1}}
NODE_RANK=${SLURM_NODEID:-${NODE_RANK:-0}}
if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
  MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
else
  MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
fi
MASTER_PORT=${MASTER_PORT:-29500}
WORLD=$((GPUS_PER_NODE * NNODES))

NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN=${HIDDEN:-1024}
HEADS=${HEADS:-8}
FFN=${FFN:-2816}
MOE_FFN=${MOE_FFN:-704}
EXPERTS=${EXPERTS:-8}
TOPK=${TOPK:-2}
TP=${TP:-1}
if [[ -z "${EP:-}" ]]; then  # the largest size that divides both the experts and the data-parallel ranks
  EP=$(( WORLD / TP < EXPERTS ? WORLD / TP : EXPERTS ))
  while (( EP > 1 && (EXPERTS % EP || (WORLD / TP) % EP) )); do EP=$(( EP - 1 )); done
fi
SEQ_LEN=${SEQ_LEN:-4096}
MICRO_BATCH=${MICRO_BATCH:-1}
DP=$(( WORLD / TP ))
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( MICRO_BATCH * DP > 8 ? MICRO_BATCH * DP : 8 ))}  # at least one micro-batch per DP rank
TRAIN_ITERS=${TRAIN_ITERS:-20}
[[ "$TRAIN_ITERS" =~ ^[1-9][0-9]*$ ]] || { echo "TRAIN_ITERS must be a positive integer, not '$TRAIN_ITERS'" >&2; exit 2; }
WARMUP=$(( TRAIN_ITERS > 2 ? 2 : TRAIN_ITERS - 1 ))  # Megatron needs fewer warm-up iterations than iterations
VOCAB=${VOCAB:-32768}
PEAKFLAT=${PEAKFLAT:-auto}
if [[ "$PEAKFLAT" == on && -z "${CHUNK_CAP:-}" && -n "$MODEL_GIVEN" ]]; then
  echo "note: CHUNK_CAP defaults to 4096 token-expert pairs, sized so that this script's small default model chunks;" \
       "for another model pass CHUNK_CAP=auto (8192 x TOPK, at least 32768) or the planner's value" >&2
fi
CHUNK_CAP=${CHUNK_CAP:-4096}
UNTIE=${UNTIE:-1}
GROUPED_GEMM=${GROUPED_GEMM:-auto}

MODEL=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN"
  --num-experts "$EXPERTS" --moe-router-topk "$TOPK" --moe-ffn-hidden-size "$MOE_FFN"
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --disable-bias-linear --normalization RMSNorm --swiglu --position-embedding-type rope
  --hidden-dropout 0 --attention-dropout 0
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
)
if [[ "$UNTIE" == 1 ]]; then MODEL+=(--untie-embeddings-and-output-weights); fi
# With Transformer Engine (NGC containers) the experts are TE's grouped GEMM (TEGroupedMLP), which PipelinedLLEP
# runs on its own grouped path; without TE, Megatron's local SequentialMLP.
if [[ "$GROUPED_GEMM" == auto ]]; then
  if "$PYTHON" -c "import transformer_engine.pytorch" >/dev/null 2>&1; then GROUPED_GEMM=1; else GROUPED_GEMM=0; fi
fi
if [[ "$GROUPED_GEMM" == 1 ]]; then MODEL+=(--moe-grouped-gemm); fi
# No dropout, as MoE pretraining recipes run; with --hidden-dropout > 0 PipelinedLLEP's fused recompute
# (--peakflat-dispatch-fuse-recompute) turns itself off, logged, and each MoE layer pays one more expert forward.
PARALLEL=(
  --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP"
  --use-distributed-optimizer
)
# Megatron's expert TP defaults to --tensor-model-parallel-size, which PipelinedLLEP refuses at start-up; the experts
# stay whole (expert parallelism shards them), off and on alike, so that the two runs keep one layout.
[[ "$TP" -gt 1 ]] && PARALLEL+=(--sequence-parallel --expert-tensor-parallel-size 1)
# A causal model needs no [s, s] mask from the dataloader; at 64K tokens Megatron's default one is 4 GiB per
# sample in host memory (megatron_peakflat.apply rejects that at start-up).
TRAIN=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.1 --clip-grad 1.0
  --bf16 --seed 1234
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --log-interval 1 --eval-iters 0 --eval-interval 1000000
  --no-create-attention-mask-in-dataloader
)
# Checkpoints and TensorBoard: a resubmitted job with the same SAVE_DIR resumes from its last checkpoint.
OUTPUTS=()
LOAD_DIR=${LOAD_DIR:-${SAVE_DIR:-}}
if [[ -n "${SAVE_DIR:-}" ]]; then OUTPUTS+=(--save "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-1000}"); fi
if [[ -n "$LOAD_DIR" ]]; then OUTPUTS+=(--load "$LOAD_DIR"); fi
if [[ -n "${TB_DIR:-}" ]]; then OUTPUTS+=(--tensorboard-dir "$TB_DIR"); fi
if [[ -n "${DATA_PATH:-}" ]]; then
  read -ra DATA_WORDS <<< "$DATA_PATH"  # one prefix, or Megatron's weighted blend "0.5 /a/text 0.5 /b/text"
  DATA=(--data-path "${DATA_WORDS[@]}" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL with DATA_PATH}")
else
  DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB")
fi
PF=()
case "$PEAKFLAT" in
  auto) PF+=(--peakflat auto --peakflat-report-peaks) ;;
  on)
    IFS=, read -ra COMPS <<< "${PEAKFLAT_COMPONENTS:-dispatch,vocab,sco,optimizer}"
    for c in "${COMPS[@]}"; do
      case "$c" in
        dispatch)  PF+=(--peakflat-dispatch pipelined-llep --peakflat-dispatch-chunk-cap "$CHUNK_CAP") ;;
        vocab)     PF+=(--peakflat-vocab ring-dtp) ;;
        vocab-ep)  PF+=(--peakflat-vocab ring-dtp --peakflat-vocab-shard-over-ep) ;;  # TP=1, EP > 1, UNTIE=1
        sco)       PF+=(--peakflat-sco) ;;
        optimizer) PF+=(--peakflat-optimizer offload-stream --optimizer-cpu-offload --use-precision-aware-optimizer) ;;
        *) echo "unknown component '$c' in PEAKFLAT_COMPONENTS: take dispatch, vocab, vocab-ep, sco or optimizer" >&2
           exit 2 ;;
      esac
    done
    PF+=(--peakflat-report-peaks) ;;
  off) ;;
  *) echo "PEAKFLAT must be auto, on or off, not '$PEAKFLAT'" >&2; exit 2 ;;
esac

read -ra USER_ARGS <<< "${MEGATRON_ARGS:-}"

SHOWN_SEQ=$SEQ_LEN  # the last --seq-length given wins, as in Megatron's parser
ALL=("${USER_ARGS[@]}" "$@")
for i in "${!ALL[@]}"; do
  case "${ALL[$i]}" in
    --seq-length) SHOWN_SEQ=${ALL[$((i + 1))]:-$SHOWN_SEQ} ;;
    --seq-length=*) SHOWN_SEQ=${ALL[$i]#--seq-length=} ;;
    --max-position-embeddings|--max-position-embeddings=*) POS_GIVEN=1 ;;
  esac
done
# the position embeddings follow a --seq-length given on the command line, unless it sets them too
POSITIONS=()
if [[ -z "${POS_GIVEN:-}" && "$SHOWN_SEQ" != "$SEQ_LEN" ]]; then
  POSITIONS=(--max-position-embeddings "$SHOWN_SEQ")
fi
LAUNCH=(
  "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m megatron_peakflat.pretrain "${MODEL[@]}" "${PARALLEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${OUTPUTS[@]}" "${PF[@]}"
  "${POSITIONS[@]}" "${USER_ARGS[@]}" "$@"
)
echo "peakflat=$PEAKFLAT nodes=$NNODES gpus/node=$GPUS_PER_NODE tp=$TP ep=$EP seq=$SHOWN_SEQ layers=$NUM_LAYERS experts=$EXPERTS"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# This script's own path, for the per-node tasks (and the container) to run. Under sbatch $0 is Slurm's spool copy,
# which only the batch node has: then the submitted script, from `scontrol show job` (its absolute path) or the
# submit directory.
find_self() {
  if [[ -n "${PEAKFLAT_SCRIPT:-}" ]]; then echo "$PEAKFLAT_SCRIPT"; return; fi
  local here
  here=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  if [[ "$here" == */examples/pretrain_moe.sh ]]; then echo "$here"; return; fi
  if command -v scontrol >/dev/null 2>&1; then
    local cmd
    cmd=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n 1)
    if [[ -n "$cmd" && "$cmd" != /* ]]; then cmd=${SLURM_SUBMIT_DIR:-.}/$cmd; fi
    if [[ -n "$cmd" && -f "$cmd" && "$cmd" == */pretrain_moe.sh ]]; then echo "$cmd"; return; fi
  fi
  if [[ -f "${SLURM_SUBMIT_DIR:-}/examples/pretrain_moe.sh" ]]; then echo "$SLURM_SUBMIT_DIR/examples/pretrain_moe.sh"; return; fi
  echo "cannot find examples/pretrain_moe.sh for the per-node tasks (\$0 is $0, submitted from" \
       "${SLURM_SUBMIT_DIR:-?}); set PEAKFLAT_SCRIPT=/absolute/path/to/examples/pretrain_moe.sh" >&2
  exit 2
}

if [[ -n "${SLURM_JOB_ID:-}" && -z "${PEAKFLAT_IN_SRUN:-}" && ( "$NNODES" -gt 1 || -n "${CONTAINER_IMAGE:-}" ) ]]; then
  # One task per node; each task runs torchrun with its own node rank, inside the container when one is named.
  SELF=$(find_self) || exit 2
  REPO=$(cd "$(dirname "$SELF")/.." && pwd)
  SRUN=(srun --ntasks-per-node=1 --kill-on-bad-exit=1)
  TASK_ENV="PEAKFLAT_IN_SRUN=1 NODE_RANK=\$SLURM_NODEID MASTER_ADDR=$MASTER_ADDR"
  if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    # each directory once, at its own path: the repository, the data (DATA_PATH may list several weighted
    # prefixes), the tokenizer when it is a file, the checkpoints and TensorBoard
    DIRS=("$REPO")
    for w in ${DATA_PATH:-}; do [[ "$w" == */* ]] && DIRS+=("$(dirname "$w")"); done
    [[ -e "${TOKENIZER_MODEL:-}" ]] && DIRS+=("$(cd "$(dirname "$TOKENIZER_MODEL")" && pwd)")
    for d in "${SAVE_DIR:-}" "${LOAD_DIR:-}" "${TB_DIR:-}"; do [[ -n "$d" ]] && DIRS+=("$d"); done
    MOUNTS=""
    for d in $(printf '%s\n' "${DIRS[@]}" | awk '!seen[$0]++'); do MOUNTS+=${MOUNTS:+,}$d:$d; done
    if [[ -n "${CONTAINER_MOUNTS:-}" ]]; then MOUNTS+=,$CONTAINER_MOUNTS; fi
    SRUN+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$MOUNTS" --container-workdir="$REPO")
    TASK_ENV+=" PYTHONPATH=$REPO\${PYTHONPATH:+:\$PYTHONPATH}"
  fi
  exec "${SRUN[@]}" bash -c "$TASK_ENV $(printf '%q ' "$SELF" "$@")"
fi
if [[ -n "${CONTAINER_IMAGE:-}" && -z "${PEAKFLAT_IN_SRUN:-}" ]]; then
  echo "CONTAINER_IMAGE=$CONTAINER_IMAGE needs SLURM with pyxis: run this script under sbatch (or salloc)," \
       "or start the container yourself and leave CONTAINER_IMAGE unset" >&2
  exit 2
fi
exec "${LAUNCH[@]}"
