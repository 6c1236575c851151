"""Read the Megatron pretraining flags that decide memory, without importing Megatron.

``parse_megatron_args("--num-layers 36 --hidden-size 2880 ...")`` accepts the same spelling as
``megatron/training/arguments.py`` for the flags the planner uses and ignores the rest (listed
back to the caller). ``from_namespace(args)`` reads the same fields from Megatron's own parsed
namespace at run time (used by integration/peaks.py).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import re
import shlex
from typing import Any, Callable, Sequence

from ..config import add_args
from ..config_base import PeakflatConfigError
from .shapes import MLA, ModelShape
from .tokenizer import vocab_from_flags

__all__ = ["megatron_parser", "parse_megatron_args", "shape_from_namespace", "run_fields_from_namespace",
           "fused_adam_importable", "layout_stage_layers", "is_command_line", "MEGATRON_DEFAULTS", "RUN_FIELDS",
           "in_training_words", "training_flag_names", "UNMODELLED", "unmodelled",
           "PRESET_MARK"]


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``low`` (a size, a count or a parallel degree), so that a zero or
    negative size is refused by name instead of dividing by zero or planning negative bytes."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not an integer >= {low}")
        return value

    parse.__name__ = "int"  # argparse's 'invalid int value' for text that is no integer
    return parse


def megatron_parser() -> argparse.ArgumentParser:
    """The memory-relevant subset of Megatron's flags, plus every --peakflat-* flag."""
    p = argparse.ArgumentParser(prog="--megatron-args", add_help=False, allow_abbrev=False)
    ints = ["num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups", "kv-channels",
            "padded-vocab-size", "vocab-size", "seq-length", "max-position-embeddings", "micro-batch-size",
            "global-batch-size",
            "tensor-model-parallel-size", "pipeline-model-parallel-size", "expert-model-parallel-size",
            "expert-tensor-parallel-size", "context-parallel-size", "num-experts", "moe-router-topk",
            "moe-ffn-hidden-size", "moe-shared-expert-intermediate-size", "recompute-num-layers",
            "q-lora-rank", "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim", "mtp-num-layers",
            "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers", "make-vocab-size-divisible-by",
            "num-layers-per-virtual-pipeline-stage", "num-virtual-stages-per-pipeline-rank",
            "microbatch-group-size-per-virtual-pipeline-stage"]
    may_be_zero = {"num-experts", "moe-shared-expert-intermediate-size", "mtp-num-layers", "q-lora-rank",
                   "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers"}
    for name in ints:
        p.add_argument("--" + name, type=_at_least(0 if name in may_be_zero else 1), default=None)
    for name in ["group-query-attention", "sequence-parallel", "bf16", "fp16", "use-distributed-optimizer",
                 "optimizer-cpu-offload", "accumulate-allreduce-grads-in-fp32", "untie-embeddings-and-output-weights",
                 "swiglu", "cross-entropy-loss-fusion", "multi-latent-attention", "deterministic-mode",
                 "account-for-embedding-in-pipeline-split", "account-for-loss-in-pipeline-split"]:
        p.add_argument("--" + name, action="store_true", default=None)
    p.add_argument("--grad-reduce-in-bf16", action="store_true", default=None)
    p.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false", default=None)
    p.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false", default=None)  # no term
    p.add_argument("--main-grads-dtype", choices=["fp32", "bf16"], default=None)
    p.add_argument("--optimizer-offload-fraction", type=float, default=None)
    # Megatron's validate_args takes --encoder-seq-length as the sequence length where --seq-length is absent
    p.add_argument("--encoder-seq-length", type=_at_least(1), default=None)  # parse_megatron_args: the length
    p.add_argument("--decoder-seq-length", type=int, default=None)  # an encoder-decoder's decoder: no GPT term
    p.add_argument("--clip-grad", type=float, default=None)  # whether an offloaded step under fp16 needs fp32 grads
    p.add_argument("--sgd-momentum", type=float, default=None)  # SGD's momentum buffer (none at 0)
    p.add_argument("--rotary-percent", type=float, default=None)  # torch RoPE's tables (te_limits.torch_rope_dim)
    for name in ("tokenizer-type", "tokenizer-model", "vocab-file", "merge-file"):  # they set the vocabulary
        p.add_argument("--" + name, default=None)
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    p.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    p.add_argument("--recompute-modules", nargs="*", default=None)
    p.add_argument("--moe-layer-freq", default=None)
    p.add_argument("--pipeline-model-parallel-layout", default=None)
    # Flags that peakflat's start-up checks read (config.py), absent unless given: ``startup_namespace`` adds
    # Megatron's defaults for a command line, so the plan leaves off what such a run would refuse.
    for flag, kw in _CHECKED_FLAGS:
        p.add_argument(flag, default=argparse.SUPPRESS, **kw)
    add_args(p)
    return p


_CHECKED_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--moe-token-dispatcher-type", {}),
    ("--optimizer", {}),
    ("--exp-avg-dtype", {}),  # what OffloadStreamAdamW refuses (optimizer/config.py)
    ("--exp-avg-sq-dtype", {}),
    ("--main-params-dtype", {}),
    ("--disable-bias-linear", {"dest": "add_bias_linear", "action": "store_false"}),
    ("--fp8-format", {"dest": "fp8"}),
    ("--fp4-format", {"dest": "fp4"}),
    ("--moe-latent-size", {"type": int}),
    ("--moe-mlp-glu-interleave-size", {"type": int}),
    ("--cuda-graph-impl", {}),
    ("--transformer-impl", {}),
    ("--offload-modules", {"nargs": "+"}),
    # what Transformer Engine runs (planner/te_limits.py) and the dataloader's mask (planner/dataloader_mask.py)
    ("--position-embedding-type", {}),
    ("--no-rope-fusion", {"dest": "apply_rope_fusion", "action": "store_false"}),
    ("--normalization", {}),
    ("--softmax-type", {}),
    ("--cp-comm-type", {"nargs": "+"}),
    ("--no-create-attention-mask-in-dataloader", {"dest": "create_attention_mask_in_dataloader",
                                                   "action": "store_false"}),
    # what the tiled sublayer refuses (tile/config.py)
    ("--hidden-dropout", {"type": float}),
    ("--attention-dropout", {"type": float}),
) + tuple((flag, {"action": "store_true"}) for flag in (
    "--moe-pad-expert-input-to-capacity", "--moe-router-padding-for-quantization", "--delay-wgrad-compute",
    "--overlap-dispatch-backward-with-experts-wgrad", "--enable-cuda-graph", "--use-te-activation-func",
    "--use-transformer-engine-op-fuser", "--moe-single-grouped-weight", "--moe-single-grouped-bias",
    "--fine-grained-activation-offloading", "--distribute-saved-activations", "--use-precision-aware-optimizer",
    "--use-rotary-position-embeddings", "--qk-layernorm", "--moe-router-fusion", "--moe-permute-fusion"))

PRESET_MARK = "planner_preset"
"""The attribute the planner sets on the flags it parsed beside a --preset (the preset's name): they override
the preset, not stand for a command line of their own."""

MEGATRON_DEFAULTS: dict[str, Any] = {"moe_token_dispatcher_type": "allgather", "add_bias_linear": True,
                                     "optimizer": "adam", "hidden_dropout": 0.1, "attention_dropout": 0.1}
"""Megatron's defaults (arguments.py) among the checked flags that a start-up check reads: a command line
that leaves them out runs the allgather dispatcher, experts with biases, Adam, and dropout 0.1."""


def is_command_line(ns: Any) -> bool:
    """Whether ``ns`` holds a Megatron command line (it names the model), whose omitted flags take Megatron's
    defaults, rather than a few flags beside a preset (``PRESET_MARK``: a flag that names the model, such as
    --num-layers, overrides that one size of the preset and keeps its other settings)."""
    if getattr(ns, PRESET_MARK, None):
        return False
    return any(getattr(ns, k, None) is not None for k in ("num_layers", "hidden_size"))


class MissingModelFlags(PeakflatConfigError):
    """The command line names no model size that the planner needs (``missing``), and no preset gives it."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = missing
        super().__init__("--megatron-args", " ".join(missing), "these model flags are missing and no --preset "
                         "supplies them", "pass them in --megatron-args or add --preset NAME")


UNMODELLED: dict[str, tuple[str | None, str]] = {
    "--optimizer": ("adam", "an optimizer other than Adam and SGD: its state is planned as Adam's (12 bytes per "
                            "parameter with fp32 master weights)"),
    "--use-megatron-fsdp": (None, "parameters and gradients sharded over data parallelism: planned whole on each "
                                  "rank (an over-plan)"),
    "--use-torch-fsdp2": (None, "parameters and gradients sharded over data parallelism: planned whole on each rank "
                                "(an over-plan)"),
    "--num-distributed-optimizer-instances": ("1", "the optimizer state sharded over a part of the data-parallel "
                                                   "group: planned over all of it (an under-plan)"),
}
"""Megatron flags that change memory and that the planner does not model, each with the value it plans (None: a
switch, planned off) and what that means; a line that sets one is told so, not that the flag changes nothing."""
MODELLED_VALUES: dict[str, tuple[str, ...]] = {"--optimizer": ("sgd",)}
"""Values of an ``UNMODELLED`` flag that the planner does model."""


def unmodelled(line: Sequence[str]) -> list[tuple[str, str]]:
    """(flag, 'flag value: what the plan assumes') for each flag of ``UNMODELLED`` that the command line ``line``
    (its tokens) sets to a value other than the one planned."""
    out = []
    for i, token in enumerate(line):
        flag, _, inline = token.partition("=")
        if flag not in UNMODELLED:
            continue
        planned, what = UNMODELLED[flag]
        value = inline or (line[i + 1] if planned is not None and i + 1 < len(line) else "")
        if planned is None or value not in (planned, *MODELLED_VALUES.get(flag, ())):
            out.append((flag, f"{flag}{' ' + value if value else ''}: {what}"))
    return out


TYPO_CUTOFF = 0.9
"""How alike (difflib's ratio) an unread flag and a read one must be for the unread one to be taken as a typo.
No other flag of megatron-core 0.19.2 comes this close to one the planner reads (tests/test_planner_cli.py)."""


def parse_megatron_args(text: str) -> tuple[argparse.Namespace, list[str]]:
    """Parse a Megatron command-line fragment; returns (namespace, ignored flags). The planner reads only the
    flags that change memory and leaves the others out, so a misspelt one of those would silently plan
    Megatron's default: a flag one letter or two from a flag it reads is refused as a typo, naming that flag."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise PeakflatConfigError("--megatron-args", text if len(text) <= 60 else text[:57] + "...",
                                  f"cannot be split into words as a shell would ({e})",
                                  "balance its quotes, or pass the flags without quotes inside") from None
    parser = megatron_parser()
    ns, unknown = parser.parse_known_args(words)
    ignored = [u for u in unknown if u.startswith("--")]
    read = [o for o in parser._option_string_actions if o.startswith("--")]
    for flag in ignored:
        name = flag.split("=", 1)[0]
        close = difflib.get_close_matches(name, read, n=1, cutoff=TYPO_CUTOFF)
        if close:
            raise PeakflatConfigError(name, None, f"is not a Megatron flag, and {close[0]} is one that changes memory",
                                      f"did you mean {close[0]}?")
    encoder = getattr(ns, "encoder_seq_length", None)
    if encoder is not None:  # Megatron's validate_args: the sequence length, and never beside --seq-length
        if ns.seq_length is not None:
            raise PeakflatConfigError("--encoder-seq-length", encoder, f"is given with --seq-length {ns.seq_length}, "
                                      "and Megatron refuses the pair", "pass one of them")
        ns.seq_length = encoder
    return ns, ignored


def _moe_pattern(freq: Any, layers: int) -> tuple[bool, ...]:
    """Which layers --moe-layer-freq makes MoE: an int N makes layer i MoE where ``i % N == 0`` (Megatron's
    ``get_gpt_decoder_block_spec``); a list (or the Python expression of one, as a command line carries it)
    marks each layer, 1 for MoE. Raises PeakflatConfigError for a list of another length than ``layers``."""
    if not isinstance(freq, (int, list, tuple)):
        text = str(freq).strip()
        try:  # Megatron evaluates it the same way (arguments.py moe_freq_type)
            freq = eval(text, {"__builtins__": {}}, {}) if "[" in text else int(text)  # noqa: S307
        except Exception as e:  # noqa: BLE001
            raise PeakflatConfigError("--moe-layer-freq", text, f"is neither an integer nor a list expression ({e})",
                                      "pass an integer N (every Nth layer MoE) or a list such as '([0]*3+[1]*58)'") from e
    if isinstance(freq, int):
        if freq < 1:
            raise PeakflatConfigError("--moe-layer-freq", freq, "must be at least 1", "pass 1 (every layer MoE) or more")
        return tuple(i % freq == 0 for i in range(layers))
    if len(freq) != layers:
        raise PeakflatConfigError("--moe-layer-freq", list(freq), f"lists {len(freq)} layers, the model has {layers}",
                                  "give one entry per layer of --num-layers (1: MoE, 0: dense)")
    return tuple(bool(v) for v in freq)


def layout_stage_layers(layout: str, kind: str = "t") -> tuple[int, ...]:
    """Layers of ``kind`` ('t' decoder, 'm' MTP) in each stage of a --pipeline-model-parallel-layout string,
    in its order (virtual stages included), read as Megatron reads it: commas are cosmetic, ``(...)*n`` and
    ``x*n`` repeat, '|' separates stages, E / L are the embedding and the loss. Raises PeakflatConfigError
    for any other character."""
    text = str(layout).replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    bad = sorted(set(text) - set("ELtm|"))
    if bad:
        raise PeakflatConfigError("--pipeline-model-parallel-layout", layout, f"holds {''.join(bad)!r}, which is not a "
                                  "layer", "write stages of E (embedding), t (decoder layer), m (MTP) and L (loss), "
                                  "separated by '|', e.g. 'Ettt|(tttt|)*2,ttL'")
    return tuple(stage.count(kind) for stage in text.split("|"))


def shape_from_namespace(ns: Any, base: ModelShape | None = None) -> ModelShape:
    """A ModelShape from Megatron flags; fields the flags leave unset come from ``base``."""
    def get(name: str, fallback: Any) -> Any:
        v = getattr(ns, name, None)
        return fallback if v is None else v

    b = base
    hidden = get("hidden_size", b.hidden if b else None)
    layers = get("num_layers", b.layers if b else None)
    heads = get("num_attention_heads", b.heads if b else None)
    missing = [f for f, v in (("--hidden-size", hidden), ("--num-layers", layers), ("--num-attention-heads", heads))
               if v is None]
    if missing:
        raise MissingModelFlags(missing)
    if b is None and getattr(ns, "kv_channels", None) is None and hidden % heads:
        # Megatron's validate_args: the head dim is hidden / heads unless --kv-channels sets it
        raise PeakflatConfigError("--num-attention-heads", heads, f"does not divide --hidden-size {hidden}, which "
                                  "Megatron refuses where --kv-channels is not given",
                                  "pass a head count that divides the hidden size, or --kv-channels")
    # Megatron reads --num-query-groups only under --group-query-attention (argument_utils.py); its parsed
    # args carry num_query_groups=1 by default, which without the flag means nothing.
    gqa = getattr(ns, "group_query_attention", None)
    kv = get("num_query_groups", 1) if gqa else None
    kv = kv if kv is not None else (b.kv_heads if b and not getattr(ns, "num_attention_heads", None) else heads)
    gated = bool(get("swiglu", b.gated if b else False))
    # Megatron's default width (arguments.py): 4h, or for swiglu 8h/3 rounded down to a multiple of 64
    ffn = get("ffn_hidden_size", b.ffn if b else (int((4 * hidden * 2 / 3) / 64) * 64 if gated else 4 * hidden))
    experts = get("num_experts", b.experts if b else 0) or 0
    vocab, vocab_source = vocab_from_flags(ns, b.vocab if b else None)
    mla = b.mla if b else None
    if getattr(ns, "multi_latent_attention", None):
        mla = MLA(q_lora_rank=get("q_lora_rank", None), kv_lora_rank=get("kv_lora_rank", 512),
                  qk_head_dim=get("qk_head_dim", 128), qk_pos_emb_head_dim=get("qk_pos_emb_head_dim", 64),
                  v_head_dim=get("v_head_dim", 128))
    freq = getattr(ns, "moe_layer_freq", None)
    pattern = _moe_pattern(freq, layers) if freq is not None else (b.moe_pattern if b else None)
    untie = getattr(ns, "untie_embeddings_and_output_weights", None)
    return ModelShape(
        name=(b.name if b else "custom") + ("+args" if b else ""),
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
        head_dim=get("kv_channels", b.head_dim if b and not getattr(ns, "num_attention_heads", None)
                     and not getattr(ns, "hidden_size", None) else hidden // heads),
        ffn=ffn, vocab=vocab, experts=experts, topk=get("moe_router_topk", b.topk if b else 2),
        moe_ffn=get("moe_ffn_hidden_size", b.moe_ffn if b else ffn),
        shared_ffn=get("moe_shared_expert_intermediate_size", b.shared_ffn if b else 0),
        dense_layers=b.dense_layers if b else 0, moe_pattern=pattern, gated=gated,
        mtp_layers=get("mtp_num_layers", b.mtp_layers if b else 0) or 0,
        tied_embeddings=(not untie) if untie is not None else (b.tied_embeddings if b else True),
        mla=mla, source=(b.source + " + " if b else "") + "Megatron flags", vocab_source=vocab_source)


def fused_adam_importable() -> bool:
    """Whether Megatron would find a FusedAdam here (Transformer Engine's, else apex's), without importing either."""
    return any(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "apex"))


RUN_FIELDS: dict[str, str] = {
    "seq_length": "seq_len", "micro_batch_size": "micro_batch", "global_batch_size": "global_batch",
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "expert_model_parallel_size": "ep", "context_parallel_size": "cp", "expert_tensor_parallel_size": "etp",
    "recompute_method": "recompute_method", "recompute_num_layers": "recompute_num_layers",
    "optimizer_offload_fraction": "optimizer_offload_fraction", "clip_grad": "clip_grad",
    "decoder_first_pipeline_num_layers": "first_stage_layers", "decoder_last_pipeline_num_layers": "last_stage_layers",
    "account_for_embedding_in_pipeline_split": "embedding_in_split",
    "account_for_loss_in_pipeline_split": "loss_in_split", "make_vocab_size_divisible_by": "vocab_divisible_by",
    "num_virtual_stages_per_pipeline_rank": "vpp", "num_layers_per_virtual_pipeline_stage": "layers_per_virtual_stage",
    "microbatch_group_size_per_vp_stage": "vp_group",
    "microbatch_group_size_per_virtual_pipeline_stage": "vp_group"}
"""Megatron's args (dests) that set a RunConfig field, by that field; the planner's own flags are the fields' names
(``--tp``, ``--micro-batch``, ``--seq-len``)."""


def training_flag_names() -> dict[str, str]:
    """The planner's own flags (its RunConfig fields' names: ``--tp``, ``--seq-len``) by the Megatron flag each
    stands for (``RUN_FIELDS``)."""
    return {"--" + field.replace("_", "-"): "--" + dest.replace("_", "-") for dest, field in RUN_FIELDS.items()}


def in_training_words(e: PeakflatConfigError, keep: Sequence[str] = (),
                      extra: dict[str, str] | None = None) -> PeakflatConfigError:
    """``e`` in the words of the training command line: each planner flag that stands for a Megatron one
    (``--ep`` for ``--expert-model-parallel-size``, ``--seq-len`` for ``--seq-length``) named by the Megatron flag,
    except those in ``keep`` (planner flags the user passed as such); ``extra`` names more (``--gpus``)."""
    names = {k: v for k, v in {**training_flag_names(), **(extra or {})}.items() if k not in keep}

    def words(text: str) -> str:
        return re.sub(r"--[a-z-]+", lambda m: names.get(m.group(0), m.group(0)), text)

    return PeakflatConfigError(names.get(e.flag, e.flag), e.value, words(e.problem), words(e.fix))


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a Megatron dtype flag's value: 'fp32', 'bf16', 'fp16', 'fp8' as given, or the
    torch dtype validate_args maps it to (fp8 is stored as uint8)."""
    name = str(dtype).removeprefix("torch.")
    return {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "uint8": 1}[name]


def run_fields_from_namespace(ns: Any) -> dict[str, Any]:
    """RunConfig fields that Megatron flags set (only those present)."""
    out: dict[str, Any] = {dst: getattr(ns, src) for src, dst in RUN_FIELDS.items() if getattr(ns, src, None) is not None}
    if "virtual_pipeline_model_parallel_size" in vars(ns):  # Megatron's validated args: what it derived, None for 1
        out["vpp"] = getattr(ns, "virtual_pipeline_model_parallel_size") or 1
    layout = getattr(ns, "pipeline_model_parallel_layout", None)
    if isinstance(layout, str):
        out["stage_layout"] = layout_stage_layers(layout)
        out["stage_layout_mtp"] = layout_stage_layers(layout, "m")
    # A Megatron command line (it names the model) means Megatron's defaults for the flags it leaves out.
    command_line = is_command_line(ns)
    if getattr(ns, "recompute_granularity", None) is not None:
        out["recompute"] = ns.recompute_granularity
    elif command_line:
        out["recompute"] = "none"  # a Megatron command line without --recompute-granularity recomputes nothing
    if getattr(ns, "recompute_modules", None) is not None:
        out["recompute_modules"] = tuple(ns.recompute_modules)
    tp = getattr(ns, "tensor_model_parallel_size", None) or 1
    if getattr(ns, "sequence_parallel", None):
        out["sequence_parallel"] = True
    elif command_line and tp > 1:  # Megatron's default: off, so each TP rank holds every token's activations
        out["sequence_parallel"] = False
        if getattr(ns, "num_experts", None):  # MoELayer.forward raises in training
            raise PeakflatConfigError("--tensor-model-parallel-size", tp, "with --num-experts, Megatron's MoE layer "
                                      "refuses to train at tensor parallelism above 1 without sequence parallelism "
                                      "(MoELayer.forward raises at the first step)", "add --sequence-parallel")
    longest, seq = getattr(ns, "max_position_embeddings", None), getattr(ns, "seq_length", None)
    if longest is not None and seq is not None and longest < seq:  # Megatron's validate_args asserts it
        raise PeakflatConfigError("--max-position-embeddings", longest, f"is below --seq-length {seq}, which "
                                  "Megatron refuses", f"pass --max-position-embeddings {seq} or more")
    if getattr(ns, "fp16", None) and getattr(ns, "bf16", None):  # Megatron's validate_args: assert not args.bf16
        raise PeakflatConfigError("--fp16", True, "is given with --bf16, and Megatron refuses the pair",
                                  "pass one of them")
    if getattr(ns, "fp16", None):
        out["precision"] = "fp16"
    elif getattr(ns, "bf16", None):
        out["precision"] = "bf16"
    elif command_line:
        out["precision"] = "fp32"  # Megatron trains in fp32 unless --bf16 or --fp16
    for src, dst in (("use_distributed_optimizer", "distributed_optimizer"),
                     ("accumulate_allreduce_grads_in_fp32", "grads_fp32"),
                     ("cross_entropy_loss_fusion", "cross_entropy_fusion"),
                     ("deterministic_mode", "deterministic"), ("bias_swiglu_fusion", "activation_fusion")):
        if getattr(ns, src, None) is not None:
            out[dst] = bool(getattr(ns, src))
    if command_line and getattr(ns, "global_batch_size", None) is None:
        out["default_micro_batches"] = 1  # Megatron's global batch defaults to micro-batch x DP: one per step
    if command_line and getattr(ns, "use_distributed_optimizer", None) is None:
        out["distributed_optimizer"] = False  # Megatron replicates the optimizer state without the flag
    # Megatron's rule for bf16 (megatron/training/arguments.py): fp32 grads unless one of these says bf16.
    main_grads = str(getattr(ns, "main_grads_dtype", None) or "")  # 'bf16' on a command line, a torch dtype once validated
    if getattr(ns, "grad_reduce_in_bf16", None) or main_grads in ("bf16", "torch.bfloat16"):
        out["grads_fp32"] = False
    optimizer = getattr(ns, "optimizer", None)
    if optimizer is not None:
        out["optimizer"] = optimizer
    if getattr(ns, "sgd_momentum", None) is not None:
        out["sgd_momentum"] = ns.sgd_momentum
    if getattr(ns, "use_precision_aware_optimizer", None):  # Megatron reads the state dtypes only with it
        for src, dst in (("exp_avg_dtype", "exp_avg_bytes"), ("exp_avg_sq_dtype", "exp_avg_sq_bytes"),
                         ("main_params_dtype", "main_params_bytes")):
            if getattr(ns, src, None) is not None:
                out[dst] = dtype_bytes(getattr(ns, src))
    if getattr(ns, "optimizer_cpu_offload", None) and "optimizer_offload_fraction" not in out:
        out["optimizer_offload_fraction"] = 1.0
    if not getattr(ns, "optimizer_cpu_offload", None) and "optimizer_offload_fraction" in out:
        out["optimizer_offload_fraction"] = 0.0
    return out

