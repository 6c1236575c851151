"""Ring-DTP in Megatron: ``GPTModel.forward`` gets an ``output_processor`` that returns the per-token loss.

The ranks that share the vocabulary are the output layer's tensor-parallel group; its vocab-parallel weight
shard (or the shared embedding passed as ``output_weight``) is each rank's shard. With the gradients computed
with the loss (Megatron's DDP gives the output layer a ``main_grad``) they run the gather schedule (all-gathers
and a reduce-scatter, ``vocab/in_forward.py``); otherwise a ring of point-to-point sends (``vocab/ring.py``). With sequence parallelism each
rank already holds its s/TP slice of the sequence. Without it the hidden states are replicated, so
each rank takes a 1/TP slice of the tokens, and the per-token losses are all-gathered (their
gradient is replicated, so backward keeps the local slice), while dX slices are all-gathered in
backward (Megatron all-reduces the replicated input's gradient; the slices here are already complete
over the vocabulary). TP=1 runs the single-device fused path.

MTP layers (``--mtp-num-layers``): Megatron's own ``process_mtp_loss`` still rolls the labels, masks, logs
and scales each MTP loss; within a Ring-DTP forward it is handed an ``MTPHead`` for the output layer and
the loss, so each MTP loss is Ring-DTP's too (gradients in backward), and the acceptance counts read the
argmax kept while folding.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import stats
from ..config_base import format_bytes
from ..main_grad import main_grad_of
from ..vocab.api import ring_linear_cross_entropy
from . import state
from .logs import PER_RANK, info_once, log
from .vocab_shard import FLAG as SHARD_FLAG
from .vocab_shard import shard_of

__all__ = ["wrap_gpt_forward", "ring_output_processor", "ring_loss", "logit_multiplier", "MTPHead", "MTPHeadLogits",
           "wrap_process_mtp_loss", "wrap_mtp_acceptance_counts"]



def _bounds(total: int, parts: int) -> list[int]:
    """Start offsets (parts + 1 of them) of a near-even split of ``total`` rows."""
    return [total * i // parts for i in range(parts + 1)]


def _gather_rows(t: torch.Tensor, bounds: list[int], group: Any) -> torch.Tensor:
    """All-gather row slices of possibly different lengths (padded to the longest for the collective)."""
    P = len(bounds) - 1
    longest = max(bounds[i + 1] - bounds[i] for i in range(P))
    pad = t.new_zeros((longest, *t.shape[1:]))
    pad[: t.shape[0]] = t
    parts = [torch.empty_like(pad) for _ in range(P)]
    dist.all_gather(parts, pad, group=group)
    return torch.cat([p[: bounds[i + 1] - bounds[i]] for i, p in enumerate(parts)])


class _GatherRowsKeepGrad(torch.autograd.Function):
    """Forward: all-gather row slices. Backward: this rank's slice of a replicated gradient."""

    @staticmethod
    def forward(ctx, t, bounds, rank, group):
        ctx.lo, ctx.hi = bounds[rank], bounds[rank + 1]
        return _gather_rows(t, bounds, group)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.lo:ctx.hi].contiguous(), None, None, None


class _SliceRowsGatherGrad(torch.autograd.Function):
    """Forward: this rank's rows of a replicated tensor. Backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, t, bounds, rank, group):
        # the group held weakly (as ring.SavedPlan holds the ring's): a graph kept alive must not keep it past
        # its destruction
        ctx.bounds, ctx.group = bounds, weakref.ref(group)
        return t[bounds[rank]:bounds[rank + 1]].contiguous()

    @staticmethod
    def backward(ctx, g):
        group = ctx.group()
        if group is None:
            raise RuntimeError("Ring-DTP backward: the tensor-parallel group of its forward no longer exists "
                               "(destroyed before this backward ran); run backward first")
        return _gather_rows(g.contiguous(), ctx.bounds, group), None, None, None


def megatron_loss_gradient(loss_mask: torch.Tensor | None, config: Any) -> torch.Tensor | None:
    """The gradient each token's loss gets from Megatron's pretraining loss, [b, s] fp32, or None when
    it cannot be known here. The loss function sums ``loss * loss_mask``; the schedule divides it by the
    microbatch's token count (``loss_mask.sum()``) and the number of microbatches unless
    ``calculate_per_token_loss``, and scales it by ``grad_scale_func`` (``forward_step_calc_loss``)."""
    if loss_mask is None:
        return None
    mask = loss_mask.float()
    scale_fn = getattr(config, "grad_scale_func", None)
    grad = (scale_fn(torch.ones(1, device=mask.device)) if scale_fn is not None
            else torch.ones(1, device=mask.device)).float().reshape(())
    if not getattr(config, "calculate_per_token_loss", False):
        try:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            microbatches = get_num_microbatches()
        except (ImportError, AttributeError):  # no global calculator: a loop that passes its own count
            return None
        grad = grad / microbatches / mask.sum().clamp(min=1)
    return mask * grad


def _resolve_grad(cfg: Any, into_main_grad: bool, loss_mask: torch.Tensor | None, config: Any
                  ) -> tuple[str, torch.Tensor | None]:
    """('in-forward', per-token gradient [b, s]) or ('recompute', None), with a log line saying why. 'auto' computes
    them with the loss (the gather schedule) when dW goes into main_grad and the schedule is auto, or when the
    schedule is gather; an activations or weights ring computes them in backward."""
    if cfg.grad == "recompute":
        return "recompute", None
    if cfg.grad == "auto" and cfg.schedule in ("activations", "weights"):
        info_once("peakflat vocab: gradients computed in backward: --peakflat-vocab-schedule %s runs a ring, which "
                  "recomputes the logits (--peakflat-vocab-schedule auto or gather computes them with the loss)",
                  cfg.schedule)
        return "recompute", None
    if cfg.grad == "auto" and cfg.schedule == "auto" and not into_main_grad:
        return "recompute", None
    if cfg.grad == "auto" and stats.snapshot().get("vocab", {}).get("hint_corrections", 0):
        info_once("peakflat vocab: the in-forward gradients missed the loss's real gradient once; recomputing "
                  "from now on (--peakflat-vocab-grad recompute says so up front)", level=logging.WARNING,
                  per_rank=True)
        return "recompute", None
    hint = megatron_loss_gradient(loss_mask, config)
    if hint is None:
        info_once("peakflat vocab: gradients computed in backward (recompute): the loss's gradient is not known "
                  "in advance here (no loss_mask, or no global microbatch count)")
        return "recompute", None
    info_once("peakflat vocab: dX and dW computed with the loss (in-forward, chunks of %s tokens): logits are "
              "computed once, not recomputed in backward", cfg.chunk_tokens or "auto")
    return "in-forward", hint


def logit_multiplier(config: Any) -> float:
    """The factor Megatron's ``LanguageModule._scale_logits`` multiplies the logits by (MuP's
    ``mup_output_mult`` when ``use_mup``; else 1)."""
    if config is None or not getattr(config, "use_mup", False):
        return 1.0
    return float(getattr(config, "mup_output_mult", 1.0))


def ring_output_processor(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: torch.Tensor | None,
                          labels: torch.Tensor, loss_mask: torch.Tensor | None = None, config: Any = None,
                          embedding_here: bool = True, **_: Any) -> torch.Tensor:
    """Megatron ``output_processor``: per-token loss [b, s] with Ring-DTP; never builds the logits.
    ``embedding_here``: this pipeline stage also holds the input embedding (``GPTModel.pre_process``, or
    its MTP layers look tokens up)."""
    loss, _ = ring_loss(hidden_states, output_layer, output_weight, labels, loss_mask, config, embedding_here)
    return loss


def ring_loss(hidden_states: torch.Tensor, output_layer: Any, output_weight: torch.Tensor | None,
              labels: torch.Tensor, loss_mask: torch.Tensor | None, config: Any, embedding_here: bool, *,
              argmax: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token loss [b, s], each token's argmax vocabulary id [b, s] with ``argmax`` else None) of the
    output layer on ``hidden_states`` [s, b, h] (s/TP rows under sequence parallelism), on every rank of the
    ring whole. ``argmax`` computes the gradients in backward (the recompute schedule keeps the argmax)."""
    cfg = state.current().vocab
    weight = output_weight if output_weight is not None else output_layer.weight
    ep_shard = shard_of(output_layer)
    group = output_layer.tp_group if ep_shard is None else ep_shard.group
    ring = dist.get_world_size(group) if dist.is_initialized() and group is not None else 1
    if (mult := logit_multiplier(config)) != 1.0:
        # MuP's output scale (``LanguageModule._scale_logits``): (m h) W^T is m (h W^T), and autograd takes
        # the scale through to dX; only the rounding point differs from scaling the logits.
        hidden_states = hidden_states * mult
    s_local, b, h = hidden_states.shape
    labels_sb = labels.transpose(0, 1)  # [s, b]
    # A tied weight on the stage that also looks tokens up gets the embedding's gradient through autograd
    # too: dW still goes into main_grad, and DDP's hook adds the embedding's (main_grad.release).
    shared = output_weight is not None and embedding_here
    into_main_grad = main_grad_of(weight) is not None
    if into_main_grad:
        info_once("peakflat vocab: the output layer's weight gradient goes straight into DDP's main_grad "
                  "(no fp32 dW accumulator)%s", "; the tied embedding's gradient joins it there" if shared else "")
    grad, hint = (_resolve_grad(cfg, into_main_grad, loss_mask, config) if torch.is_grad_enabled() and not argmax
                  else ("recompute", None))
    hint_sb = None if hint is None else hint.transpose(0, 1)  # [s, b], as labels_sb
    # a gather asked for where the gradients are computed in backward (no known loss gradient, MTP losses)
    # runs the ring 'auto' picks: the gather schedule exists only with the in-forward gradients
    schedule = "auto" if cfg.schedule == "gather" and grad == "recompute" else cfg.schedule
    common = dict(schedule=schedule, block_size=cfg.block_size, kernel=cfg.kernel, accumulate=cfg.accumulate,
                  check_labels=cfg.check_labels, dw_into_main_grad=True, weight_shared=shared, grad=grad,
                  chunk_tokens=cfg.chunk_tokens, return_argmax=argmax)

    def call(x: torch.Tensor, lab: torch.Tensor, hint_mine: torch.Tensor | None, ring_group: Any, **kw: Any
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = ring_linear_cross_entropy(x, weight, lab, ring_group, grad_hint=hint_mine, **common, **kw)
        return out if argmax else (out, None)

    def to_bs(t: torch.Tensor | None) -> torch.Tensor | None:
        """Per-token values in [s, b] order (any shape of s x b elements) as Megatron's [b, s]."""
        return None if t is None else t.view(s_local, b).transpose(0, 1).contiguous()

    if ring == 1 or ep_shard is not None:
        # One ring rank, or the expert-parallel ring: each rank's own tokens, whole (TP=1), meet every shard.
        loss, pred = call(hidden_states.reshape(-1, h), labels_sb.reshape(-1),
                          None if hint_sb is None else hint_sb.reshape(-1), group if ring > 1 else None,
                          vocab_size=None if ep_shard is None else ep_shard.vocab)
        _log_first_call(s_local * b, ring, "expert-parallel" if ep_shard is not None else "tensor-parallel")
        return to_bs(loss), to_bs(pred)
    rank = dist.get_rank(group)
    if output_layer.sequence_parallel:
        lo = rank * s_local
        lab = labels_sb[lo:lo + s_local].reshape(-1)
        loss, pred = call(hidden_states.reshape(-1, h), lab,
                          None if hint_sb is None else hint_sb[lo:lo + s_local].reshape(-1), group)
        _log_first_call(lab.numel(), ring, "tensor-parallel")
        bounds = _bounds(labels_sb.shape[0], ring)
        full = _GatherRowsKeepGrad.apply(loss.view(s_local, b), bounds, rank, group)
        preds = None if pred is None else _gather_rows(pred.view(s_local, b), bounds, group)
        return full.transpose(0, 1).contiguous(), None if preds is None else preds.transpose(0, 1).contiguous()
    tokens = hidden_states.reshape(-1, h)
    bounds = _bounds(tokens.shape[0], ring)
    mine = _SliceRowsGatherGrad.apply(tokens, bounds, rank, group)
    lab = labels_sb.reshape(-1)[bounds[rank]:bounds[rank + 1]]
    loss, pred = call(mine, lab, None if hint_sb is None else hint_sb.reshape(-1)[bounds[rank]:bounds[rank + 1]], group)
    _log_first_call(lab.numel(), ring, "tensor-parallel")
    full = _GatherRowsKeepGrad.apply(loss, bounds, rank, group)
    return to_bs(full), to_bs(None if pred is None else _gather_rows(pred, bounds, group))


_FIRST_CALL_LOGGED = False


def _log_first_call(tokens: int, ring: int, over: str) -> None:
    """After the first Ring-DTP loss of the process, from ``stats`` as ``ring_linear_cross_entropy`` recorded them:
    one line per rank of what it chose for the flags' 'auto' and 0 (the schedule, the kernel, where the gradients
    were computed, in how many chunks) and the largest block of fp32 logits it held; and one line (rank 0's,
    logs.py) of the schedule that ran and why."""
    global _FIRST_CALL_LOGGED
    if _FIRST_CALL_LOGGED:
        return
    _FIRST_CALL_LOGGED = True
    s = stats.snapshot().get("vocab", {})
    if s.get("grad") == "in-forward":
        grads = f"dX and dW computed with the loss in {s.get('in_forward_chunks', 0)} chunk(s)"
    else:
        grads = "dX and dW computed in backward (logits recomputed block by block)"
    where = f"{ring} ranks of the {over} group" if ring > 1 else "one rank"
    log.info(f"peakflat vocab: first loss call: {tokens} tokens here, {where}, schedule {s.get('schedule')}, "
             f"kernel {s.get('kernel')}, {grads}; largest block of logits {format_bytes(s.get('block_logits_bytes', 0))}",
             extra=PER_RANK)
    # the same on every rank: one line (rank 0's)
    info_once("peakflat vocab: schedule %s: %s", s.get("schedule"), s.get("schedule_reason"))


_MTP_HEAD: contextvars.ContextVar[bool | None] = contextvars.ContextVar("peakflat_mtp_head", default=None)
"""While a Ring-DTP forward runs: whether its stage looks tokens up (``embedding_here``); None otherwise."""


class MTPHeadLogits:
    """What ``MTPHead`` hands Megatron's ``process_mtp_loss`` in place of one MTP layer's logits: the layer's
    hidden states and the output weight, from which ``MTPHead.loss`` computes the loss with Ring-DTP
    (nothing of tokens x vocabulary is built) and keeps each token's argmax in ``preds`` for the acceptance
    counts."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor | None) -> None:
        self.hidden, self.weight = hidden, weight
        self.preds: torch.Tensor | None = None

    def __mul__(self, factor: float) -> "MTPHeadLogits":
        # MuP's _scale_logits: ring_loss scales the hidden states by the same logit_multiplier itself.
        return self

    __rmul__ = __mul__


class MTPHead:
    """Stands in ``process_mtp_loss`` for the output layer (called per MTP layer) and for
    ``compute_language_model_loss`` (``loss``); every other attribute is the output layer's."""

    def __init__(self, output_layer: Any, config: Any, embedding_here: bool) -> None:
        self.output_layer, self.config, self.embedding_here = output_layer, config, embedding_here

    def __getattr__(self, name: str) -> Any:
        return getattr(self.output_layer, name)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, **_: Any) -> tuple[MTPHeadLogits, None]:
        return MTPHeadLogits(hidden, weight), None

    def loss(self, labels: torch.Tensor, logits: MTPHeadLogits) -> torch.Tensor:
        """Per-token loss [b, s] of one MTP layer, gradients in backward (their scale is MTPLossAutoScaler's)."""
        loss, logits.preds = ring_loss(logits.hidden, self.output_layer, logits.weight, labels, None, self.config,
                                       self.embedding_here, argmax=True)
        return loss


def wrap_process_mtp_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return a ``process_mtp_loss`` that, inside a Ring-DTP forward, hands Megatron's own function an
    ``MTPHead`` as its output layer and loss, so each MTP layer's loss is Ring-DTP's and Megatron keeps the
    label rolling, masking, logging and loss scaling."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def process_mtp_loss(*args: Any, **kwargs: Any) -> Any:
        embedding_here = _MTP_HEAD.get()
        if embedding_here is None:
            return original(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        head = MTPHead(bound.arguments["output_layer"], bound.arguments["config"], embedding_here)
        bound.arguments["output_layer"] = head
        bound.arguments["compute_language_model_loss"] = head.loss
        info_once("peakflat vocab: the %s MTP layer loss(es) through Ring-DTP too (gradients in backward)",
                  getattr(bound.arguments["config"], "mtp_num_layers", "?"))
        return original(*bound.args, **bound.kwargs)

    return process_mtp_loss


def wrap_mtp_acceptance_counts(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return a ``_compute_mtp_acceptance_counts`` that counts an ``MTPHeadLogits``' kept argmaxes the way
    Megatron counts its logits' argmaxes (predictions equal to the rolled labels where the mask is set)."""

    @functools.wraps(original)
    def counts(mtp_logits: Any, mtp_labels: torch.Tensor, loss_mask: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(mtp_logits, MTPHeadLogits):
            return original(mtp_logits, mtp_labels, loss_mask, *args, **kwargs)
        with torch.no_grad():
            valid = loss_mask.bool()
            return ((mtp_logits.preds == mtp_labels) & valid).sum().float(), valid.sum().float()

    return counts


def _hand_back_reason(model: Any, kwargs: dict[str, Any]) -> str | None:
    if kwargs.get("output_processor") is not None:
        return "the caller passed its own output_processor"
    if not getattr(model, "post_process", True):
        return "this pipeline stage has no output layer"
    if getattr(model.output_layer, "bias", None) is not None:
        return "the output layer has a bias"
    return None


def wrap_gpt_forward(original_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Return a ``GPTModel.forward`` that passes the Ring-DTP ``output_processor`` when
    ``--peakflat-vocab ring-dtp`` is on and labels are given; otherwise it calls ``original_forward``."""

    @functools.wraps(original_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = state.get()
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        sharded = getattr(self, "post_process", False) and shard_of(self.output_layer) is not None
        reason = "no labels were given" if labels is None else _hand_back_reason(self, kwargs)
        if sharded and (reason is not None or cfg is None or cfg.vocab.impl != "ring-dtp"):
            raise RuntimeError(f"{SHARD_FLAG} holds 1/EP of the output layer's rows here, so Megatron's own output "
                               f"layer cannot build logits ({reason or 'Ring-DTP is off'}). It computes the training "
                               "loss only: for generation or logits, load the checkpoint into a model built without "
                               "the flag (its checkpoint describes the whole layer)")
        if cfg is None or cfg.vocab.impl != "ring-dtp" or labels is None:
            return original_forward(self, *args, **kwargs)
        if reason is not None:
            info_once("peakflat vocab: Megatron's own output layer and loss used: %s", reason)
            return original_forward(self, *args, **kwargs)
        info_once("peakflat vocab: Ring-DTP loss (schedule=%s, block=%s, kernel=%s); logits are not built",
                  cfg.vocab.schedule, f"{cfg.vocab.block_size} rows" if cfg.vocab.block_size else "auto",
                  cfg.vocab.kernel)
        # MTP layers look tokens up on their stage too (GPTModel builds the embedding where mtp_process).
        embedding_here = bool(getattr(self, "pre_process", True) or getattr(self, "mtp_process", False))
        kwargs["output_processor"] = functools.partial(ring_output_processor, embedding_here=embedding_here)
        token = _MTP_HEAD.set(embedding_here)
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            _MTP_HEAD.reset(token)

    return forward
