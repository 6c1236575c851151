"""The one table of every Megatron-Core symbol that megatron-peakflat replaces.

``apply(config)`` patches the entries of the enabled components; ``remove()`` restores every
original. Both are idempotent. Each replacement is built lazily by a factory
``factory(original) -> replacement`` named by dotted path, so nothing of Megatron is imported
before ``apply`` is called. Replacements read the live config through ``state.current()``, so a
second ``apply`` with another config takes effect without re-patching.

A Megatron that moved or renamed a symbol, whose function lacks a keyword a replacement
passes (``Patch.needs_params``), or whose leading parameters are no longer those a replacement reads
by position (``Patch.positional``), fails here, at start-up, with an error naming the symbol and the
megatron-core versions the entry was checked on: not with a TypeError, or a wrong argument, at the
first step. A megatron-core outside the checked range (``compat.CHECKED_ON``) gets one warning naming both
(``compat.check_megatron_version``): the names can all be there while what they mean has changed. The versions
themselves live in ``compat`` (re-exported here).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

from . import state
from .compat import CHECKED_ON, check_megatron_version, checked_since, megatron_core_version, unchecked_version_warning

__all__ = ["Patch", "PATCHES", "OTHER_OWNERS", "apply_patches", "remove_patches", "applied", "PeakflatIntegrationError",
           "CHECKED_ON", "megatron_core_version", "unchecked_version_warning", "check_megatron_version"]

log = logging.getLogger("megatron_peakflat")

OTHER_OWNERS = ("attention", "report", "moe-release", "wheel-fixes")
"""The patch owners that are no component: the SDPA core attention (``--peakflat-attention``), the peak report
(``--peakflat-report-peaks``), moe-release (the fix to Megatron's own dispatchers, with any component on) and
wheel-fixes (``python -m megatron_peakflat.pretrain`` on the megatron-core wheel)."""


class PeakflatIntegrationError(ImportError):
    """A Megatron symbol that a patch needs is missing or has moved."""


@dataclass(frozen=True)
class Patch:
    component: str
    """Which part owns it: a component's name (``components.COMPONENTS``) or one of ``OTHER_OWNERS``."""
    module: str
    """Module in which the name is bound, e.g. ``megatron.core.transformer.moe.moe_layer``."""
    attr: str
    """Attribute path inside ``module``, e.g. ``MoELayer.__init__``."""
    factory: str
    """``package.module:function`` that takes the original and returns the replacement."""
    what: str
    """One line for the log: what the replacement does."""
    checked_on: tuple[str, ...] = CHECKED_ON
    needs_params: tuple[str, ...] = ()
    """Keyword parameters the original must accept, because the replacement passes them."""
    optional: bool = False
    """Absent from some megatron-core versions, where nothing needs it: skipped there with a debug line."""
    positional: tuple[str, ...] = ()
    """The original's leading parameters, in order, where the replacement reads or passes arguments by
    position (``'*args'``: a variable positional parameter, whatever its name)."""

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.attr}"


_OPT_FACTORY = "megatron_peakflat.integration.optimizer:replace_hybrid_device_optimizer"

PATCHES: tuple[Patch, ...] = (
    Patch("dispatch", "megatron.core.transformer.moe.moe_layer", "MoELayer.__init__",
          "megatron_peakflat.integration.dispatch:wrap_moe_layer_init",
          "swaps MoELayer.token_dispatcher for PipelinedLLEP (config stays 'alltoall')"),
    Patch("dispatch", "megatron.core.transformer.moe.moe_layer", "MoELayer.routed_experts_compute",
          "megatron_peakflat.integration.dispatch:wrap_routed_experts_compute",
          "runs PipelinedLLEP's chunked dispatch -> experts -> combine for layers holding its dispatcher"),
    Patch("dispatch", "megatron.core.tensor_parallel.random", "CheckpointFunction.forward",
          "megatron_peakflat.integration.dispatch_recompute:wrap_checkpoint_forward",
          "notes the last PipelinedLLEP layer inside each checkpoint",
          positional=("ctx", "run_function", "distribute_saved_activations", "*args")),
    Patch("dispatch", "megatron.core.tensor_parallel.random", "CheckpointFunction.backward",
          "megatron_peakflat.integration.dispatch_recompute:wrap_checkpoint_backward",
          "gives that layer its output gradient during the recompute (fused chunk forward + backward)",
          positional=("ctx", "*args")),
    Patch("vocab", "megatron.core.models.gpt.gpt_model", "GPTModel.__init__",
          "megatron_peakflat.integration.vocab_shard:wrap_gpt_init",
          "cuts the output layer to this expert-parallel rank's rows if --peakflat-vocab-shard-over-ep is on; else nothing"),
    Patch("vocab", "megatron.core.models.gpt.gpt_model", "GPTModel.forward",
          "megatron_peakflat.integration.vocab:wrap_gpt_forward",
          "passes a Ring-DTP output_processor so the logits are never built", needs_params=("output_processor",),
          positional=("self", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels")),
    Patch("vocab", "megatron.core.models.gpt.gpt_model", "process_mtp_loss",
          "megatron_peakflat.integration.vocab:wrap_process_mtp_loss",
          "computes the MTP layers' losses with Ring-DTP inside Megatron's own process_mtp_loss (no logits)",
          needs_params=("output_layer", "compute_language_model_loss", "config")),
    Patch("vocab", "megatron.core.transformer.multi_token_prediction", "_compute_mtp_acceptance_counts",
          "megatron_peakflat.integration.vocab:wrap_mtp_acceptance_counts",
          "counts the MTP acceptance from the argmaxes Ring-DTP kept (0.18.2 has no such counts)",
          checked_on=checked_since((0, 19)), optional=True, positional=("mtp_logits", "mtp_labels", "loss_mask")),
    Patch("sco", "megatron.core.recompute", "checkpointed_forward",
          "megatron_peakflat.integration.sco:wrap_checkpointed_forward",
          "keeps full-recompute boundary inputs in pinned host memory"),
    Patch("sco", "megatron.core.transformer.transformer_block", "checkpointed_forward",
          "megatron_peakflat.integration.sco:wrap_checkpointed_forward",
          "same, for the name imported into transformer_block"),
    Patch("sco", "megatron.core.models.hybrid.hybrid_block", "checkpointed_forward",
          "megatron_peakflat.integration.sco:wrap_checkpointed_forward",
          "same, for the name imported into hybrid_block (HybridStack)"),
    Patch("optimizer", "megatron.core.optimizer", "HybridDeviceOptimizer", _OPT_FACTORY,
          "builds OffloadStreamAdamW where Megatron builds HybridDeviceOptimizer"),
    Patch("optimizer", "megatron.core.optimizer.distrib_optimizer", "HybridDeviceOptimizer", _OPT_FACTORY,
          "same, for DistributedOptimizer's rebuild over its shard"),
    Patch("optimizer", "megatron.core.optimizer.cpu_offloading", "HybridDeviceOptimizer", _OPT_FACTORY,
          "same, for the package-level name"),
    Patch("attention", "megatron.core.models.backends", "LocalSpecProvider.core_attention",
          "megatron_peakflat.integration.attention:wrap_local_core_attention",
          "local-spec core attention through torch SDPA (no s x s scores)"),
    Patch("tile", "megatron.core.transformer.transformer_layer", "TransformerLayer._forward_attention",
          "megatron_peakflat.integration.tile:wrap_forward_attention",
          "runs the self-attention sublayer over query tiles (only K and V whole over the sequence)",
          needs_params=("hidden_states", "attention_mask", "context", "rotary_pos_emb", "rotary_pos_cos",
                        "rotary_pos_sin", "attention_bias", "inference_context", "packed_seq_params"),
          positional=("self", "hidden_states")),
    Patch("tile", "megatron.core.transformer.transformer_layer", "TransformerLayer._forward_pre_mlp_layernorm",
          "megatron_peakflat.integration.norm_rows:wrap_forward_pre_mlp_layernorm",
          "runs the pre-MLP norm in row slices where rows x hidden passes Transformer Engine's norm kernel limit",
          positional=("self", "hidden_states")),
    Patch("tile", "megatron.core.transformer.transformer_block", "TransformerBlock.forward",
          "megatron_peakflat.integration.norm_rows:wrap_block_forward",
          "runs the final norm in row slices where rows x hidden passes Transformer Engine's norm kernel limit",
          positional=("self",)),
    Patch("tile", "megatron.core.transformer.multi_token_prediction", "MultiTokenPredictionLayer.forward",
          "megatron_peakflat.integration.norm_rows:wrap_mtp_forward",
          "runs the MTP layer's norms in row slices where rows x hidden passes Transformer Engine's limit",
          positional=("self",)),
    Patch("report", "megatron.training.training", "training_log",
          "megatron_peakflat.integration.peaks:wrap_training_log",
          "logs each component's measured peak beside the planner's every log interval"),
    Patch("moe-release", "megatron.core.transformer.moe.token_dispatcher",
          "MoEAlltoAllTokenDispatcher.combine_postprocess",
          "megatron_peakflat.integration.moe_release:release_after_combine",
          "drops the router probabilities and routing maps the alltoall dispatcher kept after combining (under "
          "recompute they held each checkpoint's input and its gradient alive until the next iteration)"),
    Patch("moe-release", "megatron.core.transformer.moe.token_dispatcher",
          "MoEAllGatherTokenDispatcher.combine_postprocess",
          "megatron_peakflat.integration.moe_release:release_after_combine",
          "same, for the allgather dispatcher (its local probabilities)"),
    Patch("wheel-fixes", "megatron.core.datasets.utils", "compile_helpers",
          "megatron_peakflat.integration.wheel_fixes:skip_compile_when_prebuilt",
          "keeps the wheel's prebuilt dataset helpers (the wheel has no Makefile to rebuild them)"),
)

# symbol -> (owner object, attribute name, original value)
_applied: dict[str, tuple[Any, str, Any]] = {}
_built: dict[tuple[str, str], Any] = {}


def _resolve(p: Patch) -> tuple[Any, str, Any]:
    try:
        owner: Any = importlib.import_module(p.module)
    except ImportError as e:
        raise PeakflatIntegrationError(
            f"megatron-peakflat needs module {p.module} (for {p.component}); it could not be imported: {e}. "
            f"This entry was checked on megatron-core {', '.join(p.checked_on)}."
        ) from e
    *path, name = p.attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            break
    if owner is None or not hasattr(owner, name):
        raise PeakflatIntegrationError(
            f"megatron-peakflat ({p.component}) patches {p.symbol}, which this megatron-core does not have. "
            f"It was checked on megatron-core {', '.join(p.checked_on)}; install one of those or turn "
            f"the {p.component} component off."
        )
    raw = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
    missing = [k for k in p.needs_params if not _accepts(raw, k)]
    if missing:
        raise PeakflatIntegrationError(
            f"megatron-peakflat ({p.component}) calls {p.symbol} with {', '.join(missing)}, which this "
            f"megatron-core's version of it does not take. It was checked on megatron-core {', '.join(p.checked_on)}; "
            f"install one of those or turn the {p.component} component off."
        )
    if p.positional and not _leads_with(raw, p.positional):
        raise PeakflatIntegrationError(
            f"megatron-peakflat ({p.component}) reads the arguments of {p.symbol} by position as "
            f"({', '.join(p.positional)}), and this megatron-core's version of it is {_signature(raw)}. It was "
            f"checked on megatron-core {', '.join(p.checked_on)}; install one of those or turn the {p.component} "
            f"component off."
        )
    return owner, name, raw


def _signature(fn: Any) -> str:
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        return f"{getattr(fn, '__name__', 'it')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return "unreadable"


def _leads_with(fn: Any, names: tuple[str, ...]) -> bool:
    """Whether ``fn``'s first parameters are ``names``, each taken by position (``'*args'``: a variable
    positional parameter), in that order (a signature that cannot be read is given the benefit of the doubt)."""
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if len(params) < len(names):
        return False
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for want, q in zip(names, params):
        if want.startswith("*"):
            if q.kind is not inspect.Parameter.VAR_POSITIONAL:
                return False
        elif q.name != want or q.kind not in by_position:
            return False
    return True


def _accepts(fn: Any, keyword: str) -> bool:
    """Whether ``fn`` can be called with ``keyword=...``: named in its signature, or taken by its ``**kwargs``
    (a signature that cannot be read is given the benefit of the doubt)."""
    fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return keyword in params or any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values())


def _load_factory(path: str) -> Callable[[Any], Any]:
    mod, fn = path.split(":")
    return getattr(importlib.import_module(mod), fn)


def applied() -> list[str]:
    """Symbols currently patched."""
    return list(_applied)


def apply_patches(components: set[str]) -> list[str]:
    """Patch every entry whose component is in ``components``; return the symbols newly patched.

    All symbols are resolved before anything is patched, so a missing symbol leaves Megatron intact. A
    megatron-core outside the checked range is logged once (``check_megatron_version``).
    """
    check_megatron_version()
    todo = [p for p in PATCHES if p.component in components and p.symbol not in _applied]
    resolved = []
    for p in todo:
        try:
            resolved.append((p, *_resolve(p)))
        except PeakflatIntegrationError as e:
            if not p.optional:
                raise
            log.debug("peakflat: %s is absent here and nothing needs it: %s", p.symbol, e)
    done = []
    for p, owner, name, original in resolved:
        key = (p.factory, repr(original))
        if key not in _built:
            base = original.__func__ if isinstance(original, staticmethod) else original
            new = _load_factory(p.factory)(base)
            try:
                new.__wrapped__ = base
                new._peakflat_patch = p.symbol
            except (AttributeError, TypeError):
                pass
            if isinstance(original, staticmethod):
                new = staticmethod(new)
            _built[key] = new
        setattr(owner, name, _built[key])
        _applied[p.symbol] = (owner, name, original)
        done.append(p.symbol)
        log.debug("peakflat: patched %s: %s", p.symbol, p.what)
    if done:  # one line: the components' own lines say what each does; DEBUG lists every symbol and why
        log.info("peakflat: patched %d Megatron symbol(s): %s", len(done), ", ".join(_short(s) for s in done))
    return done


def _short(symbol: str) -> str:
    """A patched symbol as a log line names it: its last two dotted parts (``GPTModel.forward``)."""
    return ".".join(symbol.split(".")[-2:])


def remove_patches() -> list[str]:
    """Restore every patched symbol to its original, in reverse order; return what was restored."""
    restored = []
    for sym in reversed(list(_applied)):
        owner, name, original = _applied.pop(sym)
        setattr(owner, name, original)
        restored.append(sym)
        log.debug("peakflat: restored %s", sym)
    if restored:
        log.info("peakflat: restored %d Megatron symbol(s)", len(restored))
    state.set_current(None)
    return restored
