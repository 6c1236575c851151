"""Knobs of Ring-DTP: ``--peakflat-vocab`` and ``--peakflat-vocab-*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..config_base import ComponentConfig, PeakflatConfigError, megatron_arg as _get


@dataclass(kw_only=True)
class VocabConfig(ComponentConfig):
    PREFIX: ClassVar[str] = "vocab"
    MODE_FIELD: ClassVar[str] = "impl"
    MODE_FLAG: ClassVar[str] = "vocab"

    impl: Literal["megatron", "ring-dtp"] = "megatron"
    """Output layer and loss. 'ring-dtp' computes the loss from the vocabulary-sharded projection a block
    at a time with an online log-sum-exp (the schedule says how the shards meet the tokens), so the
    [tokens, vocab] logits never exist."""
    schedule: Literal["auto", "gather", "activations", "weights"] = "auto"
    """How the P ranks holding the vocabulary shards (TP, or EP with shard_over_ep) meet every token.
    'gather': the in-forward gradients' schedule, collectives and no ring: each chunk's hidden states and
    labels are all-gathered, the log-sum-exp state all-gathered and dX reduce-scattered (6NHV).
    'activations' / 'weights': a ring of point-to-point sends where the tokens or the weight shards
    travel, gradients in backward by recomputing the logits (8NHV). 'auto': gather when the gradients
    are computed with the loss (--peakflat-vocab-grad), else activations when tokens <= vocab/P, weights
    otherwise. The first loss call logs the one taken and why."""
    block_size: int = 0
    """Vocabulary rows folded per block (0: automatic, one block of logits is about 128 MiB); the
    working set is one tokens x block_size block of logits."""
    kernel: Literal["auto", "triton", "torch"] = "auto"
    """Block kernel: Triton on CUDA, the plain-PyTorch blockwise path elsewhere ('auto')."""
    accumulate: Literal["fp32", "input"] = "fp32"
    """Dtype that dX (and, on a ring, dW) is summed in across vocabulary blocks: 'fp32' (exact, one fp32
    copy of dX) or 'input' (the gradients' own dtype, one rounding per block: bf16 stays at the gradient floor)."""
    grad: Literal["auto", "recompute", "in-forward"] = "auto"
    """When dX and dW are computed. 'in-forward': with the loss, a chunk of tokens at a time (6NHV; one
    [chunk, V/TP] block of logits), for the gradient the loss will get, which Megatron's loss function
    fixes in advance (loss_mask over the token count and the microbatches); a wrong guess is added by
    recomputing, so the gradients stay exact. 'recompute': in backward, after recomputing the logits block
    by block (8NHV; one [tokens, block_size] block). 'auto': in-forward with the gather schedule, or when
    the output layer's weight gradient goes into DDP's main_grad (Megatron's DDP gives it one, tied to the
    embedding or not) and the schedule is auto; else recompute (the activations and weights rings compute
    the gradients in backward)."""
    chunk_tokens: int = 0
    """Tokens per chunk of the in-forward schedule, over the tensor-parallel group (0: automatic, at most
    hidden-size tokens, so one [chunk, V/TP] block of logits is no larger than the weight shard, 2 GiB of
    them and 1/8 of the tokens)."""
    check_labels: bool = False
    """Check every step that labels lie in [0, vocab) or equal ignore_index (costs one host sync)."""
    shard_over_ep: bool = False
    """At TP=1 with expert parallelism, shard the (untied) output layer's rows over the expert-parallel
    group and run Ring-DTP over that group (the schedule's ranks): each rank holds V/EP rows of the weight and of its
    main_grad (and its optimizer state follows the expert parameters') instead of all V. To turn it on or off
    across a resume, save in --ckpt-format torch_dist with --dist-ckpt-optim-fully-reshardable (or resume with
    --no-load-optim)."""

    def validate(self) -> None:
        if self.schedule in ("activations", "weights") and self.grad == "in-forward":
            raise PeakflatConfigError(self.flag("schedule"), self.schedule,
                                      f"gradients computed with the loss ({self.flag('grad')} in-forward) run the "
                                      f"'gather' schedule (all-gathers and a reduce-scatter), not the {self.schedule} ring",
                                      f"pass {self.flag('schedule')} gather (or auto) to keep them, or "
                                      f"{self.flag('grad')} recompute to run the {self.schedule} ring")
        if self.schedule == "gather" and self.grad == "recompute":
            raise PeakflatConfigError(self.flag("schedule"), "gather",
                                      f"the gather schedule computes the gradients with the loss, and "
                                      f"{self.flag('grad')} recompute computes them in backward, on a ring",
                                      f"pass {self.flag('grad')} in-forward (or auto), or {self.flag('schedule')} "
                                      "auto, activations or weights")
        if self.chunk_tokens < 0 or 0 < self.chunk_tokens < 128:
            raise PeakflatConfigError(self.flag("chunk_tokens"), self.chunk_tokens,
                                      "a chunk size cannot be negative" if self.chunk_tokens < 0
                                      else "chunks under 128 tokens waste the GPU",
                                      "pass 0 (automatic) or at least 128 tokens, e.g. --peakflat-vocab-chunk-tokens 4096")
        if self.block_size and self.block_size < 16:
            raise PeakflatConfigError(self.flag("block_size"), self.block_size, "blocks under 16 rows waste the GPU",
                                      "pass 0 (automatic) or a block of 1024-16384 rows, e.g. --peakflat-vocab-block-size 4096")

    def check_against_megatron(self, args: Any) -> None:
        """Refuse, at start-up, the layouts in which --peakflat-vocab-shard-over-ep would not train as the whole
        output layer (Megatron's parsed args)."""
        if self.shard_over_ep:
            self._check_shard_over_ep(args)

    def _check_shard_over_ep(self, args: Any) -> None:
        """Refuse the layouts in which the EP-sharded output layer would not train as the whole one.

        The shard's gradient sums the tokens of the expert-parallel ring, then DDP reduces it, as an expert
        parameter, over the expert data-parallel group only. Those two groups cover every data-parallel rank
        only at --expert-tensor-parallel-size 1: at ETP > 1 (with TP=1) the expert-tensor-parallel ranks hold
        other tokens and the same rows, their gradients are never summed, and the replicas drift apart.
        """
        flag = self.flag("shard_over_ep")
        ep = _get(args, "expert_model_parallel_size", 1) or 1
        tp = _get(args, "tensor_model_parallel_size", 1) or 1
        etp = _get(args, "expert_tensor_parallel_size", 1) or 1
        pp = _get(args, "pipeline_model_parallel_size", 1) or 1
        need = [
            (self.impl == "ring-dtp", "it shards the output layer for the Ring-DTP loss",
             "add --peakflat-vocab ring-dtp"),
            (ep > 1, f"there is no expert-parallel group to shard over (--expert-model-parallel-size {ep})",
             "use it with --expert-model-parallel-size > 1, or drop " + flag),
            (tp == 1, f"--tensor-model-parallel-size is {tp}: the output layer is already vocab-parallel over the "
             "tensor-parallel group", "drop " + flag + " (Ring-DTP rings over the tensor-parallel group)"),
            (etp == 1, f"--expert-tensor-parallel-size is {etp}: the shard's gradient is summed over the expert-parallel "
             "group and reduced over the expert data-parallel group, which leave out the tokens of the other "
             f"{etp - 1} expert-tensor-parallel rank(s), so the shard would train on part of the batch and its "
             "copies drift apart", "pass --expert-tensor-parallel-size 1, or drop " + flag),
            (pp == 1, f"--pipeline-model-parallel-size is {pp}: pipeline parallelism is not supported yet",
             "pass --pipeline-model-parallel-size 1, or drop " + flag),
            (bool(_get(args, "untie_embeddings_and_output_weights", False)),
             "a tied output layer is the input embedding, which stays whole on every rank",
             "add --untie-embeddings-and-output-weights, or drop " + flag),
            ((_get(args, "make_vocab_size_divisible_by", 128) or 1) * tp % ep == 0,
             f"the padded vocabulary must split evenly over EP={ep} (--make-vocab-size-divisible-by "
             f"{_get(args, 'make_vocab_size_divisible_by', 128)})",
             f"pass --make-vocab-size-divisible-by a multiple of {ep}"),
        ]
        for ok, why, fix in need:
            if not ok:
                raise PeakflatConfigError(flag, True, why, fix)
