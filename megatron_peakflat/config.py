"""``PeakflatConfig``: every knob of the four components, the ``--peakflat-*`` flags and their checks.

The flags are derived from the component dataclasses (``config_base.ComponentConfig.add_flags``).
``PeakflatConfig.from_args(args)`` builds the config from a parsed Megatron namespace and runs
every check, the checks against Megatron's own flags included, so a bad value or an incompatible
combination fails at start-up with a message naming the flag, the value and the fix.

No Megatron import: Megatron's parsed arguments are read as a plain namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal

from . import components
from .config_base import (ComponentConfig, PeakflatConfigError, cuda_graph_flag, former_flags, megatron_arg,
                          read_dash_values, shown_default)

if TYPE_CHECKING:
    from .dispatch.config import DispatchConfig
    from .optimizer.config import OptimizerConfig
    from .sco.config import SCOConfig
    from .vocab.config import VocabConfig

log = logging.getLogger("megatron_peakflat")

__all__ = ["PeakflatConfig", "GeneralConfig", "add_args", "PeakflatConfigError", "current_spelling"]


@dataclass(kw_only=True)
class GeneralConfig(ComponentConfig):
    PREFIX: ClassVar[str] = ""

    attention: Literal["auto", "local", "sdpa"] = "auto"
    """Core attention of Megatron's local spec. 'sdpa' uses torch scaled_dot_product_attention
    (flash/memory-efficient kernels, no s x s scores), and runs --context-parallel-size > 1 (K and V
    all-gathered over the CP group), which Megatron's local attention refuses; 'auto' picks sdpa when
    Transformer Engine is absent and leaves TE's attention alone when it is present."""
    report_peaks: bool = False
    """Measure each component's peak memory and log it every log interval beside the planner's prediction."""
    log_all_ranks: bool = False
    """Log peakflat's lines from every rank, each prefixed with its rank. Without it rank 0 logs each decision
    once, and only the lines that differ per rank (measured per-rank figures, host memory) come from every
    rank, prefixed with theirs."""

    def check_against_megatron(self, args: Any) -> None:
        """The SDPA core attention's refusals, where it was asked for or 'auto' picks it under CP."""
        if self.attention == "sdpa" or _auto_sdpa_under_cp(self, args):
            _check_sdpa_attention(self, args)


def _component_configs() -> dict[str, type[ComponentConfig]]:
    """Each component's config class (``components.COMPONENTS``), then ``general``: the parts of ``PeakflatConfig``,
    in order."""
    return {**{c.name: c.config_class for c in components.COMPONENTS}, "general": GeneralConfig}


_COMPONENTS: dict[str, type[ComponentConfig]] = _component_configs()

_ComponentFields = dataclasses.make_dataclass(
    "_ComponentFields", [(c.name, c.config_class, field(default_factory=c.config_class)) for c in components.COMPONENTS],
    kw_only=True)
"""One field per row of ``components.COMPONENTS``, of its config class, defaulting to its defaults (off)."""


@dataclass(kw_only=True)
class PeakflatConfig(_ComponentFields):  # type: ignore[misc,valid-type]
    """All knobs: one field per component (``components.COMPONENTS``: dispatch, vocab, sco, optimizer), then
    ``general``. Every component is off by default: an empty command line changes nothing."""

    if TYPE_CHECKING:  # the table's fields as type checkers see them (tests/test_components.py checks them)
        dispatch: DispatchConfig = field(default_factory=DispatchConfig)
        vocab: VocabConfig = field(default_factory=VocabConfig)
        sco: SCOConfig = field(default_factory=SCOConfig)
        optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    general: GeneralConfig = field(default_factory=GeneralConfig)

    @property
    def releases_dispatcher_state(self) -> bool:
        """Whether ``apply`` adds moe-release (integration/moe_release.py), the fix to Megatron's own dispatchers:
        with any component on. The planner's peakflat column follows it."""
        return any(self.enabled.values())

    @property
    def enabled(self) -> dict[str, bool]:
        """Which components replace a Megatron part, by name, in table order."""
        return {c.name: c.is_on(getattr(self, c.name)) for c in components.COMPONENTS}

    def validate(self, megatron_args: Any | None = None) -> "PeakflatConfig":
        """Check each field, then the combinations with Megatron's flags when they are given."""
        for name in _component_configs():
            getattr(self, name).validate()
        if megatron_args is not None:
            _check_against_megatron(self, megatron_args)
        return self

    @classmethod
    def from_args(cls, args: Any, *, validate: bool = True) -> "PeakflatConfig":
        """Build from a namespace holding the ``peakflat_*`` dests (Megatron's parsed args)."""
        cfg = cls(**{name: comp.from_namespace(args) for name, comp in _component_configs().items()})
        if validate:
            cfg.validate(args)
        return cfg

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def current_spelling(flag: str) -> str:
    """The flag ``flag`` is today: a former spelling of a component's knob (``FORMER_PREFIXES``: ``--peakflat-opt-
    bucket``, or ``--no-`` before one) as its current one, any other flag unchanged."""
    negative = flag.startswith("--no-peakflat-")
    name = "--" + flag[len("--no-"):] if negative else flag
    now = _former_spellings().get(name)
    if now is None:
        return flag
    return "--no-" + now[2:] if negative else now


@functools.cache
def _former_spellings() -> dict[str, str]:
    return {old: new for comp in _component_configs().values() for old, new in former_flags(comp).items()}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``--peakflat-*`` flag. Usable as Megatron's ``extra_args_provider``. Each component's flags form
    one --help group, headed by its name (``peakflat optimizer: OffloadStreamAdamW``)."""
    parts = _component_configs()
    titles = {**{c.name: f"peakflat {c.name}: {c.title}" for c in components.COMPONENTS}, "general": "peakflat: general"}
    groups = {name: parser.add_argument_group(titles[name]) for name in parts}
    groups["general"].add_argument(
        "--peakflat", choices=["auto", "manual"], default="manual", dest="peakflat",
        help="auto: turn on the components and knobs that the peak planner recommends for this run on this "
             "machine (GPU memory, host memory, world size), and log the decision; --peakflat-* flags given "
             "alongside win. manual: exactly the --peakflat-* flags given. (default: manual)")
    for name, comp in parts.items():
        comp.add_flags(groups[name])
    read_dash_values(parser)
    return parser


def chain_args(*providers: Callable[[argparse.ArgumentParser], Any] | None
               ) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """One ``extra_args_provider`` that runs each of ``providers`` on Megatron's parser in turn and returns it.

    Megatron takes a single provider, and Megatron-LM's ``pretrain_gpt.py`` already passes one where modelopt is
    installed (as in NGC containers): ``chain_args(megatron_peakflat.add_args, add_modelopt_args if
    has_nvidia_modelopt else None)``. A None is skipped, so that conditional can stay as it is; a provider that
    returns None (instead of the parser) is allowed."""
    chain = [p for p in providers if p is not None]
    for p in chain:
        if not callable(p):
            raise TypeError(f"chain_args: {p!r} is not an extra_args_provider (a function of the parser)")

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chain:
            out = p(parser)
            parser = parser if out is None else out
        return parser

    return provider


_get = megatron_arg


def _check_against_megatron(cfg: PeakflatConfig, args: Any) -> None:
    """Reject combinations with Megatron's flags that cannot work, before any model is built: each part's own
    check (``check_against_megatron`` of each component's config, in table order, then of ``general``), then the
    notes on flags that change nothing. What a megatron-core release fails on by itself is refused beside this, at
    start-up (``integration.compat.check_args``)."""
    for name in _component_configs():
        getattr(cfg, name).check_against_megatron(args)
    for name in _component_configs():
        for note in getattr(cfg, name).unused_flag_notes():
            log.warning(note)
    for note in _sub_flag_notes(cfg):
        log.warning(note)


def check_devices(cfg: PeakflatConfig) -> None:
    """Refuse choices that need a GPU in a process that sees none (a CPU dry run of a command line): they
    would fail at the first forward otherwise. 'auto' picks what runs on either."""
    import torch

    if torch.cuda.is_available():
        return
    if cfg.vocab.impl != "megatron" and cfg.vocab.kernel == "triton":
        raise PeakflatConfigError(cfg.vocab.flag("kernel"), "triton", "the Triton block kernel runs on CUDA and this "
                                  "process sees no GPU", "pass auto (Triton on CUDA, torch elsewhere) or torch")
    if cfg.dispatch.impl != "megatron" and cfg.dispatch.transport == "copy-engine":
        raise PeakflatConfigError(cfg.dispatch.flag("transport"), "copy-engine", "copy engines move CUDA tensors and "
                                  "this process sees no GPU", "pass auto (copy engines where they apply) or nccl")


def _sub_flag_notes(cfg: PeakflatConfig) -> list[str]:
    """Sub-flags of an enabled component that another of its sub-flags makes useless (each changes nothing)."""
    notes = []
    v, o = cfg.vocab, cfg.optimizer
    if v.impl != "megatron" and v.grad == "recompute" and v.chunk_tokens:
        notes.append(f"peakflat: {v.flag('chunk_tokens')}={v.chunk_tokens} has no effect: {v.flag('grad')} recompute "
                     f"computes dX and dW in backward, block by block. Fix: drop {v.flag('chunk_tokens')}, or pass "
                     f"{v.flag('grad')} in-forward")
    if o.impl != "megatron" and o.engine == "gpu" and o.host_threads is not None:
        notes.append(f"peakflat: {o.flag('host_threads')}={o.host_threads} has no effect: {o.flag('engine')} gpu runs "
                     f"every bucket on the GPU. Fix: drop {o.flag('host_threads')}, or pass {o.flag('engine')} auto")
    return notes


def _auto_sdpa_under_cp(general: GeneralConfig, args: Any) -> bool:
    """``--peakflat-attention auto`` picks SDPA (no Transformer Engine) for a local-spec run with context
    parallelism, where nothing can be handed back to Megatron's DotProductAttention: it is checked as 'sdpa' is."""
    import importlib.util

    return (general.attention == "auto" and (_get(args, "context_parallel_size", 1) or 1) > 1
            and _get(args, "transformer_impl") == "local" and importlib.util.find_spec("transformer_engine") is None)


def _check_sdpa_attention(general: GeneralConfig, args: Any) -> None:
    """What the SDPA core attention hands back to Megatron's DotProductAttention, refused when it was asked for;
    with context parallelism, what it does not run (DotProductAttention runs no CP to hand back to)."""
    flag = general.flag("attention")
    value = general.attention
    _check_sdpa_context_parallel(flag, value, args)
    if _get(args, "transformer_impl") == "transformer_engine":
        raise PeakflatConfigError(flag, "sdpa", "it replaces the core attention of Megatron's local layer spec, and "
                                  "--transformer-impl transformer_engine builds Transformer Engine's layers, whose "
                                  "attention it never touches", f"pass --transformer-impl local, or drop {flag} "
                                  "(its default, auto, leaves TE's attention alone)")
    uncovered = _sdpa_uncovered(args)
    if uncovered:
        problem, drop = uncovered
        raise PeakflatConfigError(flag, "sdpa", f"{problem}, which would fall back to s x s scores",
                                  f"drop {drop}, or pass {flag} local")


def _sdpa_uncovered(args: Any) -> tuple[str, str] | None:
    """What the SDPA attention does not compute, at any CP: (the problem, the flag that asks for it)."""
    window = _get(args, "window_size")
    if window:
        return f"it does not cover sliding-window attention (--window-size {window})", "--window-size"
    softmax = _get(args, "softmax_type", "vanilla") or "vanilla"
    if softmax != "vanilla":
        return f"it computes the vanilla softmax only, not --softmax-type {softmax}", "--softmax-type"
    return None


_PACKED_UNDER_CP = (("sft", "--sft"), ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
                    ("hybrid_context_parallel", "--hybrid-context-parallel"))
"""Megatron flags whose batches carry packed sequences (cu_seqlens) or per-sample CP groups."""


def _check_sdpa_context_parallel(flag: str, value: str, args: Any) -> None:
    """SDPA with --context-parallel-size > 1 (K/V all-gathered over the CP group): only whole, causal sequences
    split into 2 x CP equal chunks, the vanilla softmax and no sliding window; DotProductAttention, to which
    other cases are handed back at CP 1, refuses CP."""
    cp = _get(args, "context_parallel_size", 1) or 1
    if cp <= 1:
        return
    te = "use Transformer Engine's attention (--transformer-impl transformer_engine)"
    seq = _get(args, "seq_length")
    if seq and seq % (2 * cp):
        raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} each rank holds 2 of 2 x {cp} = "
                                  f"{2 * cp} equal chunks of the sequence, and --seq-length {seq} does not split "
                                  "into them", f"pass a --seq-length that is a multiple of {2 * cp} (e.g. "
                                  f"{-(-seq // (2 * cp)) * 2 * cp}), or another --context-parallel-size")
    uncovered = _sdpa_uncovered(args)
    if uncovered:
        problem, drop = uncovered
        raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} {problem}", f"drop {drop}, or {te}")
    if _get(args, "multi_latent_attention"):
        raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} it gathers K and V of one shape, "
                                  "and multi-latent attention's keys and values differ in head size",
                                  f"drop --multi-latent-attention, or {te}")
    for dest, name in _PACKED_UNDER_CP:
        if _get(args, dest):
            raise PeakflatConfigError(flag, value, f"with --context-parallel-size {cp} it attends whole sequences "
                                      f"split in Megatron's load-balanced layout, not the packed sequences of {name}",
                                      f"drop {name}, or {te}")


def flags_markdown() -> str:
    """The README's flags table, derived from the dataclasses (``python -m megatron_peakflat.config``)."""
    parser = add_args(argparse.ArgumentParser(add_help=False))
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:  # a former spelling's alias
            continue
        flag = " / ".join(f"`{o}`" for o in action.option_strings)
        choices = f" ({', '.join(map(str, action.choices))})" if action.choices else ""
        text = (action.help or "").replace("%%", "%").rsplit(" (default:", 1)[0]
        rows.append(f"| {flag}{choices} | `{shown_default(action.default)}` | {text} |")
    return "\n".join(rows)


def flags_document() -> str:
    """docs/flags.md: a short header and ``flags_markdown``'s table (``python -m megatron_peakflat.config >
    docs/flags.md`` regenerates it)."""
    return ("# Flags\n\n"
            "Every `--peakflat-*` flag, generated from the config dataclasses in `megatron_peakflat/config.py` and\n"
            "the components' own config files (regenerate with `python -m megatron_peakflat.config > docs/flags.md`).\n"
            "Every component is off by default: a command line without these flags runs Megatron's own dispatch,\n"
            "loss, recompute and optimizer. One default acts alone: without Transformer Engine, `--peakflat-attention\n"
            "auto` makes the core attention of Megatron's local spec torch's SDPA (`local` keeps Megatron's). A bad\n"
            "value or a combination that cannot run fails at start-up, naming the flag, the value and the fix.\n"
            "Sizes take units (`16GiB`, `512MiB`, `2e9`); counts take suffixes (`50M`, `2.5B`).\n\n"
            + flags_markdown() + "\n" + _former_note())


def _former_note() -> str:
    """docs/flags.md's closing note: the former spellings still read (``FORMER_PREFIXES``), by component."""
    renamed = {f"`--peakflat-{old}-*`": f"`--peakflat-{comp.PREFIX}-*`" for comp in _component_configs().values()
               for old in comp.FORMER_PREFIXES}
    if not renamed:
        return ""
    pairs = ", ".join(f"{old} (now {new})" for old, new in renamed.items())
    return (f"\nFormer spellings, still read with one warning each per process: {pairs}. They are left out of "
            "`--help`.\n")


if __name__ == "__main__":
    print(flags_document(), end="")
