"""``--peakflat auto``: turn on the components and knobs that the peak planner recommends for this run.

``auto_argv(argv)`` runs before Megatron parses its flags, because a recommendation can need Megatron
flags of its own (full recompute for SCO; the distributed, offloaded optimizer for OffloadStreamAdamW).
It plans the command line exactly as ``python -m megatron_peakflat.plan --megatron-args "<argv>"`` does,
for this machine: the GPU's total memory, the node's total RAM shared by its local ranks, and the world
size torchrun gives. Those figures are the same on every rank of a homogeneous job (free memory is not),
so every rank makes the same choice without a process group. A flag the user wrote always wins: a
recommended flag that the command line already holds is left as the user wrote it, and a component whose
switch the user set is left entirely to the user.

No Megatron import: the planner reads the command line itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
from typing import Any, Sequence

from . import components
from .config import _COMPONENTS, current_spelling
from .config_base import PeakflatConfigError, flag_name, format_bytes
from .runtime import machine

__all__ = ["AutoChoice", "NothingFits", "NOTHING_FITS", "resolve", "auto_argv", "wants_auto", "planner_argv", "resolved_in_this_process"]

log = logging.getLogger("megatron_peakflat")

FLAG = "--peakflat"
_SWITCHES = {name: flag_name(cls, cls.MODE_FIELD) for name, cls in _COMPONENTS.items() if cls.MODE_FIELD}
"""Each component's switch (``--peakflat-dispatch``, ..., ``--peakflat-optimizer``), from its config class."""
_COMPONENT_PREFIXES = {name: (_SWITCHES[name], *(f"--peakflat-{p}-" for p in (_COMPONENTS[name].PREFIX,
                                                                               *_COMPONENTS[name].FORMER_PREFIXES)))
                       for name in _SWITCHES}
"""The flags of each component: its switch and its knobs (``--peakflat-<PREFIX>-*``, and their former spellings,
``FORMER_PREFIXES``, which a user's command line may still hold)."""
_COMPONENT_MEGATRON_FLAGS = {name: (*getattr(cls, "MEGATRON_FLAGS", ()), *getattr(cls, "MEGATRON_FLAGS_WHERE_NEEDED", ()))
                             for name, cls in _COMPONENTS.items()}
"""The Megatron flags a component's mode needs (``OptimizerConfig.MEGATRON_FLAGS``): they belong to that component,
so that a user who sets its switch keeps Megatron's flags as given too."""
_resolved: list["AutoChoice"] = []

NOTHING_FITS = 3
"""The exit status where nothing fits (the planner's and peakflat-check's, with or without --peakflat auto)."""


class NothingFits(PeakflatConfigError):
    """``--peakflat auto`` found no configuration that fits: not a refused flag, so its exit status is
    ``NOTHING_FITS`` (3), as the planner's and peakflat-check's are for the same run without auto."""


@dataclasses.dataclass
class AutoChoice:
    """What ``--peakflat auto`` decided: the flags it added, the recommended flags it left out because the
    command line sets them (``kept``: as the planner would have written them), the plan, and the line."""

    added: list[str]
    kept: list[str]
    recommendation: Any  # planner.recommend.Recommendation
    planner_args: list[str]
    argv: list[str] = dataclasses.field(default_factory=list)
    adam_source: str = ""
    """Where the planned Adam came from: this machine's installation (training start-up), else the planner's
    default for the line's --transformer-impl."""

    def table(self) -> str:
        """The decision, a few lines: each component on or off, its peak term before and after, and why."""
        rec = self.recommendation
        final = self.final_config()
        pl = rec.plan if final.enabled == rec.config.enabled else _plan(rec.plan.shape, rec.plan.run, final)
        st = pl.worst("peakflat")
        run = pl.run
        on = final.enabled
        given = _flag_groups(self.argv)
        lines = [f"peakflat auto: planned for {run.world} GPU(s) of {run.hbm_bytes / 2**30:.1f} GiB "
                 f"(TP{run.tp} PP{run.pp} CP{run.cp} DP{run.dp} EP{run.ep}), "
                 f"{format_bytes(run.host_bytes_per_rank)} of host memory per rank, sequence {run.seq_len:,}; "
                 f"--transformer-impl {run.transformer_impl}, Adam {'fused' if run.fused_adam else 'torch'}"
                 + (f" ({self.adam_source})" if self.adam_source else ""),
                 f"  {'component':20s} {'choice':6s} {'peak term, GiB: Megatron -> peakflat':38s} why"]
        for comp in components.COMPONENTS:
            name = comp.name
            row = next((st.rows[t] for t in comp.planner_terms if t in st.rows), None)
            user = next((g for g in given if _flag_set(g[0]) == _SWITCHES[name]), None)
            choice = "on" if on[name] else "off"
            if row is not None:
                term = f"{row.baseline / 2**30:8.2f} -> {row.peakflat / 2**30:8.2f}"
            else:
                term = "-"
            why = _why(name, rec, user, row)
            lines.append(f"  {comp.label:20s} {choice:6s} {term:38s} {why}")
        guaranteed = max(s.total("peakflat", guaranteed=True) for s in pl.stages)
        base = pl.worst("baseline").total("baseline")
        lines.append(f"  predicted peak {st.total('peakflat') / 2**30:.1f} GiB per GPU ({guaranteed / 2**30:.1f} "
                     f"whatever the routing), binding '{components.term_label(st.binding('peakflat'))}'; "
                     f"Megatron alone "
                     f"{base / 2**30:.1f} GiB ({'fits' if pl.fits('baseline') else 'does not fit'})")
        if not pl.fits("peakflat", guaranteed=True):
            lines.append(f"  warning: with the flags this command line sets itself, the run is predicted NOT to fit in "
                         f"{run.hbm_bytes / 2**30:.1f} GiB; the planner's own choice would")
        lines.append("  added: " + (" ".join(self.added) or "nothing"))
        for group in _flag_groups(self.added):  # the Megatron flags the line needs beside the components, and why
            said = next((r for r in rec.reasons if r.startswith(group[0] + ":")), None)
            if said is not None:
                lines.append(f"  added {said}")
        if self.kept:
            names = {g[0] for g in _flag_groups(self.kept)}
            mine = [" ".join(g) for g in given if _flag_set(g[0]) in names]
            lines.append("  recommended but set on the command line (kept as given): " + " ".join(dict.fromkeys(mine)))
        return "\n".join(lines)

    def final_config(self) -> Any:
        """The PeakflatConfig of the command line with the added flags: the recommendation, less what the line overrode."""
        from .config import PeakflatConfig
        from .planner.megatron_args import megatron_parser

        ns, _ = megatron_parser().parse_known_args(_without_auto(self.argv) + self.added)
        return PeakflatConfig.from_args(ns, validate=False)


def _plan(shape: Any, run: Any, cfg: Any) -> Any:
    from .planner.model import plan

    return plan(shape, run, cfg)


def _why(name: str, rec: Any, user: tuple[str, ...] | None, row: Any = None) -> str:
    if user is not None:
        return f"set on the command line ({' '.join(user)})"
    said = [r for r in rec.reasons if components.get(name).label in r or (name == "optimizer" and "optimizer" in r)]
    if said:
        return said[0]
    if rec.config.enabled[name]:
        if name in ("sco", "optimizer"):
            return "needed to fit"
        if row is not None and row.peakflat > row.baseline:  # a small run: balanced routing, few tokens
            return ("bounds this peak whatever the routing, at no loss of exactness (Megatron's is smaller here "
                    "with balanced routing, and grows with skew)")
        return "bounds this peak at no loss of exactness"
    return "not needed"


def wants_auto(argv: Sequence[str]) -> bool:
    """Whether the command line says ``--peakflat auto`` (or ``--peakflat=auto``); the last one wins."""
    value = None
    for i, a in enumerate(argv):
        if a == FLAG and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(FLAG + "="):
            value = a.split("=", 1)[1]
    return value == "auto"


def _flag_set(word: str) -> str:
    """The flag a word sets, as it is spelt today: ``--x=1`` sets ``--x``, an off switch (``--no-peakflat-sco``) its
    switch, a former spelling (``--peakflat-opt-bucket``) the current flag (``--peakflat-optimizer-bucket``)."""
    name = current_spelling(word.split("=", 1)[0])
    return "--" + name[len("--no-"):] if name.startswith("--no-peakflat-") else name


def _given_flags(argv: Sequence[str]) -> set[str]:
    return {_flag_set(a) for a in argv if a.startswith("--")}


def _flag_groups(flags: Sequence[str]) -> list[tuple[str, ...]]:
    """``['--a', '1', '--b', '--c', 'x']`` -> ``[('--a', '1'), ('--b',), ('--c', 'x')]``."""
    groups: list[list[str]] = []
    for f in flags:
        if f.startswith("--") or not groups:
            groups.append([f])
        else:
            groups[-1].append(f)
    return [tuple(g) for g in groups]


def _without_auto(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == FLAG:
            skip = True
            continue
        if a.startswith(FLAG + "="):
            continue
        out.append(a)
    return out


def planner_argv(argv: Sequence[str], *, gpus: int, gpus_per_node: int, hbm_bytes: int,
                 host_bytes_per_node: int) -> list[str]:
    """The arguments of ``python -m megatron_peakflat.plan`` that plan this Megatron command line on this machine,
    in the parallel layout the line runs (``--layout given``: Megatron's sizes where it sets none)."""
    # one argument, so that a line that is a single flag ('--bf16') is not read as a planner flag
    return [f"--megatron-args={shlex.join(_without_auto(argv))}", "--gpus", str(gpus),
            "--gpus-per-node", str(gpus_per_node), "--hbm-gib", repr(hbm_bytes / 2**30),
            "--host-gib", repr(host_bytes_per_node / 2**30), "--layout", "given"]


def _machine() -> tuple[int, int, int, int]:
    """(world size, local ranks, GPU total bytes, node total RAM bytes) for this process.

    The GPU's total memory comes from torch on this rank's device (LOCAL_RANK), which torchrun sets and
    Megatron selects next; without a GPU the planner's default (80 GiB) stands in and is logged. Host memory
    is the node's MemTotal: identical on every node of a homogeneous job, so every rank plans alike.
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = machine.local_world_size(default=1)
    hbm = None
    try:
        import torch

        if torch.cuda.is_available():
            device = int(os.environ.get("LOCAL_RANK", "0") or 0) % max(1, torch.cuda.device_count())
            torch.cuda.set_device(device)
            hbm = int(torch.cuda.mem_get_info(device)[1])
    except Exception as e:  # noqa: BLE001
        log.warning("peakflat auto: could not read the GPU's memory (%s: %s); planning for 80 GiB", type(e).__name__, e)
    if hbm is None:
        log.info("peakflat auto: no GPU visible; planning for 80 GiB per GPU")
        hbm = 80 * 2**30
    host = machine.mem_total()
    return world, local, hbm, host if host is not None else 2048 * 2**30


def resolve(argv: Sequence[str], *, gpus: int | None = None, gpus_per_node: int | None = None,
            hbm_bytes: int | None = None, host_bytes_per_node: int | None = None,
            installed_adam: bool = False) -> AutoChoice:
    """The planner's recommendation for ``argv`` and the flags to add to it. Machine figures left out are read
    from this process (``_machine``). ``installed_adam``: plan the Adam that Megatron finds installed here (the
    training machine's truth: TE's or apex's FusedAdam, else torch's), not the planner's default. Raises
    PeakflatConfigError naming ``--peakflat auto`` when nothing fits, with the planner's reasons and fixes, or when
    the planner cannot read the command line."""
    from .planner.build import build
    from .planner.megatron_args import MissingModelFlags, in_training_words
    from .planner.recommend import recommend

    if None in (gpus, gpus_per_node, hbm_bytes, host_bytes_per_node):
        world, local, hbm, host = _machine()
        gpus = world if gpus is None else gpus
        gpus_per_node = min(local, gpus) if gpus_per_node is None else gpus_per_node
        hbm_bytes = hbm if hbm_bytes is None else hbm_bytes
        host_bytes_per_node = host if host_bytes_per_node is None else host_bytes_per_node
    args = planner_argv(argv, gpus=gpus, gpus_per_node=gpus_per_node, hbm_bytes=hbm_bytes,
                        host_bytes_per_node=host_bytes_per_node)
    source = ""
    if installed_adam:
        from .planner.megatron_args import fused_adam_importable

        fused = fused_adam_importable()
        args += ["--adam", "fused" if fused else "torch"]
        source = ("installed here: Transformer Engine's or apex's FusedAdam" if fused else
                  "installed here: neither Transformer Engine nor apex, so torch.optim.AdamW")
    try:
        shape, run, pf, ns, _ = build(args)
    except MissingModelFlags as e:
        raise PeakflatConfigError(FLAG, "auto", f"the command line names no {' '.join(e.missing)}, so the planner "
                                  "has no model to plan", "add them, or drop --peakflat auto") from e
    except PeakflatConfigError as e:
        said = in_training_words(e, extra={"--gpus": "the world size"})  # auto sets the planner's flags itself
        value = "" if said.value is None else f"={said.value!r}"
        raise PeakflatConfigError(FLAG, "auto", f"the planner cannot read this command line: {said.flag}{value} "
                                  f"{said.problem}", f"{said.fix}; or pass the "
                                  f"--peakflat-* flags yourself in place of {FLAG} auto") from e
    rec = recommend(shape, run, pf, ns.megatron_namespace)
    if not rec.fits:
        raise NothingFits(FLAG, "auto", f"nothing fits in this command line's layout ({_layout(run)}): " +
                                  "; ".join(rec.reasons), "apply one of the fixes above" + _picked_layout(args) +
                                  f" (python -m megatron_peakflat.plan {shlex.join(args)} shows the figures)")
    given = _given_flags(argv)
    user_switched = {name for name, switch in _SWITCHES.items() if switch in given}
    added: list[str] = []
    kept: list[str] = []
    for group in _flag_groups(rec.flags):
        owner = next((n for n, prefixes in _COMPONENT_PREFIXES.items() if group[0].startswith(prefixes)
                      or group[0] in _COMPONENT_MEGATRON_FLAGS[n]), None)
        if group[0] in given or (owner is not None and owner in user_switched):
            kept.extend(group)
        else:
            added.extend(group)
    _check_transformer_engine(argv, added, rec)
    return AutoChoice(added, kept, rec, args, list(argv), source)


def _check_transformer_engine(argv: Sequence[str], added: list[str], rec: Any) -> None:
    """Raise the refusal of a Transformer Engine length limit that the line with the added flags still passes
    (``planner.te_limits.line_refusal``: fused RoPE is switched off by ``--no-rope-fusion`` among the added flags;
    no flag lifts the norms' or the fused router's and permutation's), before Megatron parses anything."""
    from .planner import te_limits
    from .planner.megatron_args import megatron_parser

    ns, _ = megatron_parser().parse_known_args(_without_auto(list(argv)) + added)
    refusal = te_limits.line_refusal(rec.plan.shape, rec.plan.run, ns)
    if refusal is not None:
        raise refusal


def _layout(run: Any) -> str:
    return f"TP{run.tp} PP{run.pp} CP{run.cp} DP{run.dp} EP{run.ep}"


def _picked_layout(args: list[str]) -> str:
    """Where the layout the planner would pick for these GPUs fits (and Transformer Engine runs it), that layout's
    flags, as a fix."""
    from .planner import te_limits
    from .planner.build import build
    from .planner.recommend import recommend

    pick = list(args)
    pick[pick.index("--layout") + 1] = "pick"
    try:
        shape, run, pf, ns, _ = build(pick)
    except PeakflatConfigError:  # the picked layout does not suit this line (a sequence CP does not divide, ...)
        return ""
    rec = recommend(shape, run, pf, ns.megatron_namespace)
    if not rec.fits or te_limits.hard_refusal(shape, run, ns.megatron_namespace) is not None:
        return ""
    return f", or train in a layout that fits on these GPUs: {' '.join(rec.layout_flags)}"


def auto_argv(argv: Sequence[str]) -> list[str]:
    """The flags ``argv`` (no program name) with those that ``--peakflat auto`` chose added, and the decision
    logged once (rank 0). Unchanged when the command line does not ask for it. Call it before Megatron parses
    its flags: ``sys.argv[1:] = megatron_peakflat.auto_argv(sys.argv[1:])``."""
    argv = list(argv)
    if not wants_auto(argv):
        return argv
    choice = resolve(argv, installed_adam=True)
    _resolved.append(choice)
    if int(os.environ.get("RANK", "0") or 0) == 0:
        log.info("%s", choice.table())
    return argv + choice.added


def resolved_in_this_process() -> bool:
    """Whether ``auto_argv`` has resolved ``--peakflat auto`` in this process (``apply`` checks it)."""
    return bool(_resolved)
