"""``python -m megatron_peakflat.check`` (``peakflat-check``): what this machine gives megatron-peakflat, and
whether a command line would start. No GPU is needed: a login node will do.

    peakflat-check
        one screen: the native extension (its C++ and CUDA parts), Transformer Engine, apex, triton, the
        megatron-core version against the versions checked, the GPUs and host RAM, and what each component
        will use here.

    peakflat-check <Megatron flags> <--peakflat-* flags> [--gpus N] [--gpus-per-node N] [--hbm-gib G] [--host-gib G]
        parses the line with Megatron's own parser and checks (``megatron.training.arguments``: its errors come
        through as they are), checks every --peakflat-* flag against the rest of the line as training start-up
        does, then prints the planner's table for the run and whether this configuration fits. ``--peakflat auto``
        is resolved first, as start-up resolves it, for the GPUs and memory given here. --gpus is the
        run's GPU count (default: the smallest that the parallel sizes allow); --hbm-gib and --host-gib the
        GPU's memory and a node's RAM (default: this machine's GPU, else 80; this machine's RAM when it has a
        GPU, else 2048).

Exit status: 0 when the line is accepted and fits; 2 when Megatron or peakflat refuses it; 3 when it does not
fit (``cli.plan.NOTHING_FITS``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import math
import os
import platform
import re
import shlex
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Sequence

from .. import __version__, auto
from .._environ import environment
from ..config import PeakflatConfig
from ..planner import te_limits
from ..startup import config_from_args
from ..config_base import PeakflatConfigError

__all__ = ["main", "report", "check_command_line", "REFUSED", "DOES_NOT_FIT"]

REFUSED = 2
"""Exit status when Megatron or peakflat refuses the command line."""
DOES_NOT_FIT = 3
"""Exit status when the configuration does not fit the GPU or the host (the planner's NOTHING_FITS)."""

PROG = "python -m megatron_peakflat.check"
_GIB = 2**30


# ---- what is installed ---------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_version(module: str, *dists: str) -> str | None:
    """The installed version of ``module`` (by its distributions' metadata, without importing it), '' when it is
    importable without metadata, None when it is not importable."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    return next((v for v in map(_version, dists) if v), "")


def _gpus() -> list[str]:
    """One line per visible GPU (name and memory), through torch."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(f"{i}: {p.name}, {p.total_memory / _GIB:.0f} GiB, sm_{p.major}{p.minor}")
    return out


def _host_ram() -> tuple[float, float] | None:
    """(MemTotal, MemAvailable) in GiB from /proc/meminfo; None where it is unreadable. MemAvailable is read
    through ``runtime.host``, the figure the components size their pinned memory from."""
    from ..runtime import host, machine

    total, available = machine.mem_total(), host.mem_available()
    return None if total is None else (total / _GIB, math.nan if available is None else available / _GIB)


def _megatron_symbols() -> tuple[int, list[str]]:
    """(how many of the patch registry's Megatron symbols were found, the missing ones with the error) on the
    installed megatron-core, resolved without patching anything."""
    from ..integration import registry

    found, missing = 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's import-time notices (no Transformer Engine, ...)
        for p in registry.PATCHES:
            try:
                registry._resolve(p)
                found += 1
            except registry.PeakflatIntegrationError as e:
                if not p.optional:
                    missing.append(f"{p.symbol}: {str(e).splitlines()[0]}")
            except Exception as e:  # noqa: BLE001 - a module that fails to import is reported, not raised
                missing.append(f"{p.symbol}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    return found, missing


def _extension_lines() -> list[str]:
    from .. import _ext

    if _ext.needs_compile():
        print(f"(compiling the native extension on its first use, once: a minute or two; cached in {_ext.cache_root()})",
              flush=True)
    module = _ext.load()
    if module is None:
        lines = [f"extension          MISSING: {_ext.reason()}",
                 f"                   falls back: {_ext.FALLBACKS}"]
        log = _ext.build_log().strip().splitlines()
        if log:
            lines.append("                   compiler output (last lines):")
            lines += [f"                     {line}" for line in log[-8:]]
        return lines
    cuda = bool(getattr(module, "with_cuda", False))
    how = {"prebuilt": "built at install time", "jit": "built on first use"}.get(_ext.source(), _ext.source())
    where = _ext.reason() if _ext.source() == "jit" else getattr(module, "__file__", "")
    return [f"extension          megatron_peakflat._C {how}: C++ parts yes, CUDA parts {'yes' if cuda else 'no'}",
            f"                   {where}"]


def report() -> str:
    """The no-argument screen: what is installed and what each component will use here."""
    import torch

    from .. import _ext
    from ..integration.compat import CHECKED_ON, REQUIREMENT, megatron_core_version
    from ..planner.megatron_args import fused_adam_importable

    lines = [f"megatron-peakflat {__version__}   python {platform.python_version()}   torch {torch.__version__} "
             f"(CUDA {torch.version.cuda or 'none'})"]
    lines += _extension_lines()
    module = _ext.load()  # the outcome _extension_lines had: one attempt per process
    te = _module_version("transformer_engine", "transformer-engine", "transformer_engine", "transformer-engine-torch")
    apex = _module_version("apex", "apex")
    triton = _module_version("triton", "triton", "pytorch-triton")
    mcore = megatron_core_version() or _module_version("megatron", "megatron-core")

    def shown(v: str | None) -> str:
        return "not installed" if v is None else (v or "installed")

    lines.append(f"Transformer Engine {shown(te)}")
    lines.append(f"apex               {shown(apex)}")
    lines.append(f"triton             {shown(triton)}")
    if mcore is None:
        lines.append(f"megatron-core      not installed (checked on {', '.join(CHECKED_ON)}): pip install "
                     f"'{REQUIREMENT}'")
    else:
        base = mcore.split("+")[0]
        verdict = "checked" if base in CHECKED_ON else f"NOT among the versions checked ({', '.join(CHECKED_ON)})"
        found, missing = _megatron_symbols()
        lines.append(f"megatron-core      {mcore}: {verdict}; {found} of {found + len(missing)} symbols peakflat "
                     f"replaces found")
        lines += [f"                   missing: {m}" for m in missing]
    gpus = _gpus()
    lines.append(f"GPUs               {len(gpus) or 'none visible'}" + ("" if gpus else
                 " (fine for checking a command line; training needs them)"))
    lines += [f"                   {g}" for g in gpus]
    ram = _host_ram()
    lines.append("host RAM           " + ("unreadable" if ram is None else
                                       f"{ram[0]:.1f} GiB total, {ram[1]:.1f} GiB available"))
    cuda = bool(gpus)
    native = module is not None
    streams = native and bool(getattr(module, "with_cuda", False)) and cuda
    lines.append("components here:")
    if not hasattr(torch, "_grouped_mm"):
        gemms = "one expert at a time (this torch has no _grouped_mm)"
    elif cuda and torch.cuda.get_device_capability(0)[0] < 8:
        gemms = "one expert at a time (grouped GEMMs need sm80+)"
    else:
        gemms = "grouped (torch._grouped_mm" + (", bf16)" if cuda else ")")
    lines.append("  PipelinedLLEP      expert GEMMs " + gemms + "; combine " + ("Triton" if cuda and triton is not None
                                                                            else "PyTorch")
                 + "; all-to-alls " + ("NCCL (overlapped calls: copy engines where the EP group is on one host)"
                                       if cuda else "through the process group's backend"))
    lines.append("  Ring-DTP           block kernel " + ("Triton" if cuda and triton is not None else "PyTorch")
                 + (" (triton missing: pip install triton)" if cuda and triton is None else ""))
    lines.append("  SCO                host pool: torch pinned tensors (--peakflat-sco-pool native: "
                 + ("the extension's" if native else "falls back to torch, no extension") + ")")
    lines.append("  OffloadStreamAdamW host Adam step " + ("native (the extension)" if native else "PyTorch")
                 + "; bucket streams " + ("native (CUDA parts)" if streams else "PyTorch"
                                          + ("" if cuda else " (no GPU here)")))
    lines.append("  attention          " + ("Transformer Engine's (left in place)" if te is not None else
                                         "peakflat's SDPA attention (no Transformer Engine; --peakflat-attention)"))
    lines.append("  Megatron optimizer " + ("FusedAdam (Transformer Engine or apex)" if fused_adam_importable() else
                                         "torch AdamW (no Transformer Engine or apex FusedAdam)"))
    return "\n".join(lines)


# ---- a command line --------------------------------------------------------------------------------

def _own_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    p.add_argument("--gpus", type=int, help="the run's total GPU count")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: 8)")
    p.add_argument("--hbm-gib", type=float, help="GPU memory per device, GiB")
    p.add_argument("--host-gib", type=float, help="host RAM per node, GiB")
    return p


def _smallest_world(args: Any) -> int:
    """The fewest GPUs Megatron accepts for the line's parallel sizes (``planner.build.smallest_world``)."""
    from ..planner.build import smallest_world

    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    return smallest_world(tp, getattr(args, "pipeline_model_parallel_size", None) or 1,
                          getattr(args, "context_parallel_size", None) or 1,
                          getattr(args, "expert_model_parallel_size", None) or 1,
                          getattr(args, "expert_tensor_parallel_size", None))


class _ShortUsage:
    """While active, argparse's usage on an error is one line, not Megatron's hundreds of flags."""

    def __enter__(self) -> None:
        self._saved = argparse.ArgumentParser.format_usage
        argparse.ArgumentParser.format_usage = lambda parser: (  # type: ignore[method-assign]
            f"usage: {PROG} <Megatron flags> <--peakflat-* flags> [--gpus N] [--hbm-gib G] [--host-gib G]\n")

    def __exit__(self, *exc: Any) -> None:
        argparse.ArgumentParser.format_usage = self._saved  # type: ignore[method-assign]


def _megatron_args(flags: list[str], gpus: int | None) -> tuple[argparse.Namespace, int, str]:
    """Megatron's parsed and validated args for ``flags`` at ``gpus`` GPUs (or the fewest it accepts), the GPU
    count used and a note on how they were parsed. An argparse error exits (SystemExit 2, as Megatron's
    pretraining would); validate_args's own errors propagate as they are."""
    from ..config import add_args

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # import-time notices (no Transformer Engine, ...): the plain check says
            from megatron.training.arguments import parse_args, validate_args
    except ImportError as e:
        from ..planner.megatron_args import MEGATRON_DEFAULTS, megatron_parser

        parser = megatron_parser()
        with _ShortUsage():
            ns, unknown = parser.parse_known_args(flags)
        for k, v in MEGATRON_DEFAULTS.items():
            if not hasattr(ns, k):
                setattr(ns, k, v)
        world = gpus or _smallest_world(ns)
        note = (f"megatron.training is not importable here ({e}): the flags were read by the planner's parser, "
                f"which checks the --peakflat-* flags and the Megatron flags that decide memory; unknown flags: "
                f"{' '.join(u for u in unknown if u.startswith('--')) or 'none'}")
        return ns, world, note
    saved = sys.argv
    sys.argv = [PROG, *flags]
    try:
        with _ShortUsage():
            args = parse_args(extra_args_provider=add_args)
    finally:
        sys.argv = saved
    world = gpus or _smallest_world(args)
    args.world_size, args.rank = world, 0
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter), _AsIfHopper() as assumed, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Could not determine rank")  # no process group here, by design
        validate_args(args, {})  # it prints every argument
    return args, world, ("parsed and validated by Megatron's parse_args and validate_args"
                         + (" (as on a Hopper GPU: none is visible here)" if assumed else ""))


class _AsIfHopper:
    """Where no GPU is visible, Megatron's ``validate_args`` asks for one's architecture in a few checks (TP or CP
    above 1, grouped GEMM): answer as a Hopper GPU (sm_90) would, for the length of the call. The job's
    environment is not this shell's: CUDA_DEVICE_MAX_CONNECTIONS is taken as the launcher sets it (1) when unset
    (``examples/pretrain_moe.sh`` does)."""

    def __enter__(self) -> bool:
        import torch
        from megatron.training import arguments

        self._saved: list[tuple[Any, str, Any]] = []
        self._env = "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
        if self._env:  # the job's launcher sets it (Megatron requires 1 with TP or CP above 1); not this shell
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        if torch.cuda.is_available():
            return False
        for owner, name, value in ((arguments, "get_device_arch_version", lambda: 9),
                                   (torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))):
            if hasattr(owner, name):
                self._saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, value)
        return True

    def __exit__(self, *exc: Any) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        if self._env:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)


def _attention_is_sdpa(args: Any, cfg: PeakflatConfig) -> bool:
    """Whether start-up would put the SDPA core attention in Megatron's local spec for this line."""
    from .. import _attention_wanted

    return getattr(args, "transformer_impl", "transformer_engine") == "local" and _attention_wanted(cfg)


def _said(e: BaseException) -> str:
    """An error's message; for a bare ``assert`` (Megatron's checks have many), the asserting line and where."""
    if str(e):
        return str(e)
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "(no message)"
    last = frames[-1]
    line = (last.line or "").strip()
    missing = re.fullmatch(r"assert args\.(\w+) is not None", line)
    fix = f". Fix: pass --{missing.group(1).replace('_', '-')}" if missing else ""  # a flag Megatron needs given
    return f"{line} ({Path(last.filename).name}:{last.lineno}){fix}"


def check_command_line(argv: Sequence[str]) -> int:
    """Check a training command line without a GPU; prints the planner's table and the verdict; returns the
    exit status (0 fits, ``REFUSED``, ``DOES_NOT_FIT``)."""
    from ..planner.build import build
    from ..planner.megatron_args import in_training_words, unmodelled
    from ..planner.model import plan
    from ..planner.recommend import recommend
    from ..planner.report import render

    own, flags = _own_parser().parse_known_args(list(argv))
    for flag, value, fix in (("--gpus", own.gpus, "pass the run's total GPU count, e.g. --gpus 16"),
                             ("--gpus-per-node", own.gpus_per_node, "pass the GPUs of one node, e.g. 8"),
                             ("--hbm-gib", own.hbm_gib, "pass the GPU memory in GiB, e.g. --hbm-gib 80"),
                             ("--host-gib", own.host_gib, "pass the node's RAM in GiB, e.g. --host-gib 2048")):
        if value is not None and not 0 < value < math.inf:
            print(f"error: {PeakflatConfigError(flag, value, 'must be a positive number', fix)}", file=sys.stderr)
            return REFUSED
    auto_table = None
    nothing_fits: auto.NothingFits | None = None
    try:
        if auto.wants_auto(flags):  # resolved before Megatron parses, as pretraining does
            try:
                flags, own.gpus, auto_table = _resolve_auto(flags, own)
            except auto.NothingFits as e:  # Megatron's own checks below still refuse a line they refuse
                nothing_fits, flags = e, auto._without_auto(flags)
        args, world, note = _megatron_args(flags, own.gpus)
    except SystemExit as e:  # argparse's error, printed already
        return int(e.code) if isinstance(e.code, int) and e.code else REFUSED
    except PeakflatConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return REFUSED
    except Exception as e:  # noqa: BLE001 - Megatron's own checks (assertions mostly): as they are
        print(f"error: Megatron refused the command line: {type(e).__name__}: {_said(e)}", file=sys.stderr)
        return REFUSED
    if nothing_fits is not None:  # the line is accepted; it does not fit, as without --peakflat auto
        print(f"error: {nothing_fits}", file=sys.stderr)
        return DOES_NOT_FIT
    try:
        # the ranks per host, which start-up reads from the launcher
        with environment({"LOCAL_WORLD_SIZE": str(min(own.gpus_per_node or 8, world))}):
            cfg = config_from_args(args)
        notes = _startup_notes(args, cfg)
    except PeakflatConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return REFUSED
    if auto_table:
        print(auto_table)
    print(f"Megatron flags: {note}; {world} GPUs")
    on = [name for name, enabled in cfg.enabled.items() if enabled]
    alone = "none (Megatron runs unchanged)"
    if not on and _attention_is_sdpa(args, cfg):
        alone = "none (Megatron runs with its local spec's core attention on torch's SDPA: --peakflat-attention auto)"
    print(f"peakflat flags: accepted; components on: {', '.join(on) or alone}")
    for line in notes:
        print(f"note: {line}")
    for _, line in unmodelled(flags):
        print(f"warning: not modelled, {line}")
    planner = [f"--megatron-args={shlex.join(flags)}", "--gpus", str(world), "--layout", "given"]
    for flag, value in (("--gpus-per-node", own.gpus_per_node), ("--hbm-gib", own.hbm_gib),
                        ("--host-gib", own.host_gib)):
        if value is not None:
            planner += [flag, str(value)]
    try:
        shape, run, pf_all, ns, _ = build(planner)
        refusal = te_limits.line_refusal(shape, run, args)  # Megatron's validated args: fusion as it resolved it
        if refusal is not None:
            raise refusal
        pl_all = plan(shape, run, pf_all)
        rec = recommend(shape, run, pf_all, ns.megatron_namespace)
    except PeakflatConfigError as e:  # in the line's words: the planner's --tp is the line's TP flag
        print(f"error: {in_training_words(e, extra={'--gpus': 'the world size'})}", file=sys.stderr)
        return REFUSED
    print()
    print(render(pl_all, rec))
    mine = plan(shape, run, cfg)
    expected = max(s.total("peakflat") for s in mine.stages)
    bound = max(s.total("peakflat", guaranteed=True) for s in mine.stages)
    host = max(s.host("peakflat") for s in mine.stages)
    fits = mine.fits("peakflat", guaranteed=True)
    if not fits and not rec.fits and any("attention scores" in st.rows for st in mine.stages):
        scores = max(st.rows["attention scores"].peakflat for st in mine.stages if "attention scores" in st.rows)
        print(f"error: {te_limits.scores_refusal(run, scores)}", file=sys.stderr)
        return DOES_NOT_FIT  # the line does not fit; the error names what sends it past the GPU
    print()
    print(f"this command line ({', '.join(on) or 'no component'} on): {expected / _GIB:.1f} GiB per GPU expected, "
          f"{bound / _GIB:.1f} GiB whatever the routing, of {run.hbm_bytes / _GIB:.0f} GiB; {host / _GIB:.1f} GiB "
          f"host per rank of {run.host_bytes_per_rank / _GIB:.0f} GiB -> {'fits' if fits else 'does NOT fit'}")
    if not fits:
        print("  the 'recommended' flags above are the planner's way to fit" if rec.fits else
              "  " + _closing(shape, run, pf_all, ns.megatron_namespace))
    return 0 if fits else DOES_NOT_FIT


def _closing(shape: Any, run: Any, pf: PeakflatConfig, megatron_args: Any) -> str:
    """The closing line where no recommendation fits the line's own settings: what the planner's fixes give.
    Full recompute (the fix it names for activations) is tried on the same GPUs; where it fits, its flags."""
    import dataclasses

    from ..planner.recommend import recommend

    if run.recompute != "full":
        with_full = recommend(shape, dataclasses.replace(run, recompute="full"), pf, megatron_args)
        if with_full.fits:
            flags = with_full.flags if "--recompute-granularity" in with_full.flags else \
                ["--recompute-granularity", "full", *with_full.flags]
            return ("nothing fits with this line's recompute; with --recompute-granularity full it fits on the same "
                    "GPUs: " + " ".join([*with_full.layout_flags, *flags]))
    return ("nothing the planner sizes fits" + ("" if run.recompute == "full" else ", full recompute included") +
            ": apply one of the fixes the 'why' lines name (they change the layout, the GPU count or the GPU "
            "memory)")


def _resolve_auto(flags: list[str], own: argparse.Namespace) -> tuple[list[str], int, str]:
    """``--peakflat auto`` resolved as training start-up resolves it, for the GPUs and memory given here (the
    fewest GPUs the parallel sizes allow, and the planner's defaults, where not given): (the flags with the
    chosen ones added, the GPU count, the decision's table). Raises PeakflatConfigError when nothing fits."""
    from ..planner.build import machine_gib
    from ..planner.megatron_args import megatron_parser

    gpus = own.gpus or _smallest_world(megatron_parser().parse_known_args(auto._without_auto(flags))[0])
    hbm, host = machine_gib(own.hbm_gib, own.host_gib)
    choice = auto.resolve(flags, gpus=gpus, gpus_per_node=min(own.gpus_per_node or 8, gpus),
                          hbm_bytes=int(hbm * _GIB), host_bytes_per_node=int(host * _GIB))
    return flags + choice.added, gpus, choice.table()


def _startup_notes(args: Any, cfg: PeakflatConfig) -> list[str]:
    """The start-up checks of ``megatron_peakflat.apply`` that need no GPU and no checkpoint, beyond the flags'
    own: the dataloader's attention mask. Raises PeakflatConfigError where start-up would refuse."""
    if not any(cfg.enabled.values()):
        return []
    from ..integration.attention import check_dataloader_mask

    note = check_dataloader_mask(args)
    return [note] if note else []


def main(argv: Sequence[str] | None = None) -> int:
    """``peakflat-check``: the report with no arguments, else the command-line check; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    from .. import _ext

    _ext.quiet_cpp_extension()  # imported quietly first: Megatron's import of it would log torch's no-CUDA note
    try:
        if not argv:
            print(report())
            return 0
        return check_command_line(argv)
    finally:
        with contextlib.suppress(BrokenPipeError, ValueError):
            sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
