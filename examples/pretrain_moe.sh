#!/usr/bin/env bash
# Train a small MoE GPT with Megatron-Core, peakflat off or on. Mock data unless DATA_PATH is set.
#
#   examples/pretrain_moe.sh            # PEAKFLAT=on (default): every peakflat component on
#   PEAKFLAT=off examples/pretrain_moe.sh
#   sbatch examples/pretrain_moe.sh     # under SLURM: one srun task per node, torchrun per node
#   examples/pretrain_moe.sh --save /ckpt --save-interval 100   # extra flags go to Megatron
#
# Environment (defaults in brackets): GPUS_PER_NODE [all visible], NUM_LAYERS [4], HIDDEN [1024],
# HEADS [8], FFN [2816], MOE_FFN [704], EXPERTS [8], TOPK [2], EP [GPUS_PER_NODE*NNODES, capped at EXPERTS],
# TP [1], SEQ_LEN [4096], MICRO_BATCH [1], GLOBAL_BATCH [8, or MICRO_BATCH x data-parallel ranks when more], TRAIN_ITERS [20], VOCAB [32768], UNTIE [1] (0: output
# layer tied to the embedding), GROUPED_GEMM [auto: 1 when Transformer Engine imports, adding --moe-grouped-gemm; 0],
# PEAKFLAT [on], PEAKFLAT_COMPONENTS [dispatch,vocab,sco,optimizer; vocab-ep in place of vocab also shards the
# output layer over the EP group; sco and optimizer cost PCIe time every step, so take only the components that
# `python -m megatron_peakflat.plan --megatron-args "..."` recommends], CHUNK_CAP [4096, so that this small model chunks;
# auto: 8192 x TOPK pairs, at least 32768], DATA_PATH,
# TOKENIZER_MODEL, PYTHON [python3],
# MEGATRON_ARGS [none: more Megatron flags, split on spaces, e.g. "--optimizer-cpu-offload --use-precision-aware-optimizer"].
#
#SBATCH --job-name=peakflat-moe
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=peakflat-moe-%j.out
set -euo pipefail

PYTHON=${PYTHON:-python3}
GPUS_PER_NODE=${GPUS_PER_NODE:-$($PYTHON -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
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
EP=${EP:-$(( WORLD / TP < EXPERTS ? WORLD / TP : EXPERTS ))}
SEQ_LEN=${SEQ_LEN:-4096}
MICRO_BATCH=${MICRO_BATCH:-1}
DP=$(( WORLD / TP ))
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( MICRO_BATCH * DP > 8 ? MICRO_BATCH * DP : 8 ))}  # at least one micro-batch per DP rank
TRAIN_ITERS=${TRAIN_ITERS:-20}
VOCAB=${VOCAB:-32768}
PEAKFLAT=${PEAKFLAT:-on}
if [[ -z "${CHUNK_CAP:-}" && -n "${HIDDEN:-}${SEQ_LEN:-}${EXPERTS:-}${TOPK:-}${MICRO_BATCH:-}" ]]; then
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
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
  --bf16 --seed 1234
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --log-interval 1 --eval-iters 0 --eval-interval 1000000
  --no-create-attention-mask-in-dataloader
)
if [[ -n "${DATA_PATH:-}" ]]; then
  DATA=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL with DATA_PATH}")
else
  DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB")
fi
PF=()
case "$PEAKFLAT" in
  on)
    IFS=, read -ra COMPS <<< "${PEAKFLAT_COMPONENTS:-dispatch,vocab,sco,optimizer}"
    for c in "${COMPS[@]}"; do
      case "$c" in
        dispatch)  PF+=(--peakflat-dispatch pipelined-llep --peakflat-dispatch-chunk-cap "$CHUNK_CAP") ;;
        vocab)     PF+=(--peakflat-vocab ring-dtp) ;;
        vocab-ep)  PF+=(--peakflat-vocab ring-dtp --peakflat-vocab-shard-over-ep) ;;  # TP=1, EP > 1, UNTIE=1
        sco)       PF+=(--peakflat-sco) ;;
        optimizer) PF+=(--peakflat-optimizer offload-stream --optimizer-cpu-offload --use-precision-aware-optimizer) ;;
        *) echo "unknown component '$c' in PEAKFLAT_COMPONENTS" >&2; exit 2 ;;
      esac
    done
    PF+=(--peakflat-report-peaks) ;;
  off) ;;
  *) echo "PEAKFLAT must be on or off, not '$PEAKFLAT'" >&2; exit 2 ;;
esac

read -ra USER_ARGS <<< "${MEGATRON_ARGS:-}"

LAUNCH=(
  "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m megatron_peakflat.pretrain "${MODEL[@]}" "${PARALLEL[@]}" "${TRAIN[@]}" "${DATA[@]}" "${PF[@]}" "${USER_ARGS[@]}" "$@"
)
echo "peakflat=$PEAKFLAT nodes=$NNODES gpus/node=$GPUS_PER_NODE tp=$TP ep=$EP seq=$SEQ_LEN layers=$NUM_LAYERS experts=$EXPERTS"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
if [[ -n "${SLURM_JOB_ID:-}" && -z "${PEAKFLAT_IN_SRUN:-}" && "$NNODES" -gt 1 ]]; then
  # One task per node; each task runs torchrun with its own node rank. sbatch runs a spool copy of this script
  # that only the batch node has, so the tasks run the submitted one (sbatch from the repository root, or set
  # PEAKFLAT_SCRIPT).
  SELF=${PEAKFLAT_SCRIPT:-$0}
  if [[ -z "${PEAKFLAT_SCRIPT:-}" && -f "${SLURM_SUBMIT_DIR:-}/examples/pretrain_moe.sh" ]]; then
    SELF=$SLURM_SUBMIT_DIR/examples/pretrain_moe.sh
  fi
  exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \
    "PEAKFLAT_IN_SRUN=1 NODE_RANK=\$SLURM_NODEID MASTER_ADDR=$MASTER_ADDR $(printf '%q ' "$SELF" "$@")"
fi
exec "${LAUNCH[@]}"
