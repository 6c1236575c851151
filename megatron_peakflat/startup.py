"""Start-up: ``apply`` checks the configuration and patches Megatron-Core for the enabled components, ``remove``
undoes it, ``auto_argv`` resolves ``--peakflat auto``. Re-exported by the package (``megatron_peakflat.apply``)."""

from __future__ import annotations

import logging
from typing import Any

from .config import PeakflatConfig, PeakflatConfigError

__all__ = ["apply", "remove", "auto_argv", "config_from_args"]

log = logging.getLogger("megatron_peakflat")


def apply(config: "PeakflatConfig | Any") -> PeakflatConfig:
    """Patch Megatron-Core for every enabled component; idempotent.

    ``config`` is a PeakflatConfig or Megatron's parsed args (holding the ``--peakflat-*`` flags).
    Every check runs before anything is patched. Returns the active config. From here on rank 0 alone logs
    each decision (``--peakflat-log-all-ranks``: every rank); a refused configuration leaves logging as it was.
    """
    from .integration.logs import install_rank_filter, restore_rank_filters

    # first, so that validation's own notes already come from rank 0 only
    previous = install_rank_filter(config.general.log_all_ranks if isinstance(config, PeakflatConfig)
                                   else bool(getattr(config, "peakflat_log_all_ranks", False)))
    try:
        return _apply(config)
    except BaseException:
        restore_rank_filters(previous)
        raise


def _apply(config: "PeakflatConfig | Any") -> PeakflatConfig:
    """``apply`` once the rank filter is in place."""
    from .integration import registry, state

    if getattr(config, "peakflat", None) == "auto":
        from . import auto

        if not auto.resolved_in_this_process():
            raise PeakflatConfigError(
                auto.FLAG, "auto", "it is resolved before Megatron parses its flags, since the planner's choice can "
                "add Megatron flags (full recompute for SCO, the offloaded optimizer), and nothing resolved it here",
                "call sys.argv[1:] = megatron_peakflat.auto_argv(sys.argv[1:]) before parse_and_validate_args, "
                "or launch with python -m megatron_peakflat.pretrain")
    if isinstance(config, PeakflatConfig):
        cfg = config.validate()
    else:
        cfg = config_from_args(config)
    components = {name for name, on in cfg.enabled.items() if on}
    if _attention_wanted(cfg):
        components.add("attention")
    if cfg.general.report_peaks:
        components.add("report")
    if cfg.releases_dispatcher_state:
        components.add("moe-release")  # a memory fix to Megatron's own dispatchers
    from_args = not isinstance(config, PeakflatConfig)
    if from_args:
        from .config import check_devices
        from .integration.resume import check_resume

        check_devices(cfg)
        check_resume(config, cfg)  # raises when the checkpoint in --load could not be loaded with these flags
    if components and from_args:
        from .integration.attention import check_dataloader_mask

        note = check_dataloader_mask(config)  # raises, before anything is patched, when it cannot run
        if note:
            log.warning(note)
    state.set_current(cfg)
    if from_args:
        from .integration import peaks

        peaks.setup(config)  # clears the planner's cached plan: the host check and the advice below share one
        try:
            note = peaks.check_optimizer_host(config)  # raises, before anything is patched, on a clear miss
        except Exception:
            state.set_current(None)
            raise
        if note:
            log.warning(note)
        try:
            peaks.check_transformer_engine(config)  # raises, before anything is patched, where TE would fail
        except Exception:
            state.set_current(None)
            raise
    registry.apply_patches(components)
    if from_args:
        advice = peaks.advise(config)
        if advice:
            log.info(advice)
    if not components:
        log.info("peakflat: no component enabled; Megatron runs unchanged")
    elif components == {"attention"}:
        log.info("peakflat: no component enabled; Megatron runs with its local spec's core attention on torch's "
                 "SDPA (--peakflat-attention auto without Transformer Engine; 'local' keeps Megatron's)")
    return cfg


def config_from_args(args: Any) -> PeakflatConfig:
    """The config in Megatron's parsed ``args``, with every start-up check: its own and those against Megatron's
    flags (``PeakflatConfig.from_args``), and what the installed megatron-core release fails on by itself
    (``integration.compat.check_args``). Raises PeakflatConfigError naming the flag and the fix."""
    from .integration import compat

    cfg = PeakflatConfig.from_args(args)
    compat.check_args(cfg, args)
    return cfg


def auto_argv(argv: Any) -> list[str]:
    """``argv`` (the flags, no program name) with what ``--peakflat auto`` chose added; see ``megatron_peakflat.auto``."""
    from .auto import auto_argv as resolve

    return resolve(argv)


def remove() -> list[str]:
    """Restore every Megatron symbol that ``apply`` replaced, and let every rank log again."""
    from .integration import registry
    from .integration.logs import remove_rank_filter

    remove_rank_filter()
    return registry.remove_patches()


def _attention_wanted(cfg: PeakflatConfig) -> bool:
    mode = cfg.general.attention
    if mode == "local":
        return False
    if mode == "sdpa":
        return True
    from .integration.attention import transformer_engine_available

    return not transformer_engine_available()
