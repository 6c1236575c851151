"""``OffloadStreamAdamW``: AdamW whose fp32 master weights and moments live in host buckets.

Semantics are ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, amsgrad off, per-group
lr / weight decay / betas / eps, params without a gradient skipped). Gradients are read from
``param.decoupled_grad`` when present (Megatron's precision-aware path), else ``param.grad``; loss
scaling and clipping are applied to those gradients by the caller before ``step()``, exactly as
Megatron's ``MixedPrecisionOptimizer.step`` does for any inner optimizer. The model parameters may be
bf16 or fp32, on a GPU or the CPU; they receive the updated master weights after each step.

State contract (what Megatron's DistributedOptimizer checkpointing reads and writes):
``state[param]`` holds ``step``, ``exp_avg``, ``exp_avg_sq`` and ``master_param``, each a view of
the host buckets; ``_sync_hdo_state_to_sub_optimizers()`` adopts tensors that were put in their place;
``update_fp32_param_by_new_param()`` reloads the masters from the model params; ``dummy_step()``
materialises the state; ``sub_optimizers`` is ``[self]``.

The host state is allocated lazily (first ``step``, ``state_dict``, ``dummy_step`` or ``load_state_dict``),
so an instance that is only built to be rebuilt (Megatron builds the optimizer over the whole model,
then again over each rank's shard) never allocates.
"""

from __future__ import annotations

import logging
import time
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping

import torch

from .. import stats
from ..config_base import format_bytes
from ..runtime import host, machine, meter
from ..runtime.meter import region
from .streamer import NativeStreamer
from .engines import CpuEngineWorker, GroupHyper, HostSlot, Slot, Streams, run_gpu_engine
from .host_memory import HostRegion, check_host_budget
from .layout import Layout, plan_layout

__all__ = ["OffloadStreamAdamW"]

log = logging.getLogger("megatron_peakflat")

_AUTO_MEASURE_STEPS = 3
_FIXED_GPU_FRACTION = {"gpu": 1.0, "cpu": 0.0}
"""Share of the buckets sent through the GPU per engine; 'auto' measures its own."""
_UNSUPPORTED = ("amsgrad", "maximize")


def _default_host_threads() -> int:
    """This rank's share of the cores it may run on (LOCAL_WORLD_SIZE ranks share a node)."""
    return max(1, machine.usable_cores() // host.local_ranks())


def _refuse_unsupported(options: dict[str, Any], where: str) -> None:
    """ValueError when ``options`` (defaults, a param group, a saved group) turn on an Adam variant
    that the step does not implement: it would otherwise be silently ignored."""
    for k in _UNSUPPORTED:
        if options.get(k):
            raise ValueError(f"OffloadStreamAdamW: {k}=True is not supported ({where})")


_STATE_TENSORS = ("master_param", "exp_avg", "exp_avg_sq")
"""The keys of ``state[param]`` that live in the host buckets (``step`` is a count, kept apart)."""
_LOAD = "OffloadStreamAdamW.load_state_dict"


def _checked_step(value: Any, where: str) -> int:
    """A saved Adam step as an int: a non-negative whole number (an int, a float or a one-element tensor)."""
    try:
        x = float(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value)
    except (TypeError, ValueError, RuntimeError):
        x = math.nan
    if not (math.isfinite(x) and x >= 0 and x == int(x)):
        raise ValueError(f"{_LOAD}: {where}: saved step {value!r} is not a non-negative whole number")
    return int(x)


def _check_state_tensor(value: Any, key: str, p: torch.Tensor, where: str, what: str) -> torch.Tensor:
    """``value`` when it can stand for ``p``'s ``key`` state: a real floating-point tensor of ``p``'s own shape
    (so also its element count). A ValueError names ``where`` and both shapes otherwise; a tensor of the same
    element count but another shape is refused too (a 53x37 state is not a 37x53 parameter's)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: {what} {key!r} is a {type(value).__name__}, not a tensor")
    if not value.is_floating_point() or value.is_meta:
        raise ValueError(f"{where}: {what} {key!r} is a {value.dtype} tensor on {value.device}; the host state "
                         f"holds real floating-point values (fp32), so a {value.dtype} one cannot be its state")
    if value.shape != p.shape:
        raise ValueError(f"{where}: {what} {key!r} has shape {tuple(value.shape)} ({value.numel():,} "
                         f"elements), this parameter has shape {tuple(p.shape)} ({p.numel():,} elements): the state "
                         f"belongs to other parameters, or to these in another order; load it into an optimizer "
                         f"built over the parameters it was saved with, in the same order")
    return value


def _overlaps(src: torch.Tensor, flats: Iterable[torch.Tensor]) -> bool:
    """Whether ``src``'s bytes overlap any of ``flats`` (the host buckets): a copy into the buckets must read it
    first, or an earlier copy could overwrite it."""
    if src.device.type != "cpu" or src.numel() == 0:
        return False
    lo = src.data_ptr()
    hi = lo + src.numel() * src.element_size()
    return any(f.device.type == "cpu" and lo < f.data_ptr() + f.numel() * f.element_size() and f.data_ptr() < hi
               for f in flats)


@dataclass(frozen=True)
class _LoadPlan:
    """Everything a ``load_state_dict`` changes, from a state dict checked whole before any change."""

    hyper: list[dict[str, Any]]
    """Per param group, the saved hyperparameters to take."""
    steps: dict[int, int]
    """Flat parameter index -> its Adam step (its saved group's, else its own)."""
    copies: list[tuple[int, str, torch.Tensor]]
    """(flat parameter index, state key, saved tensor of the parameter's shape)."""
    fraction: float | None
    measured: list[tuple]

    @staticmethod
    def check(opt: "OffloadStreamAdamW", state_dict: Mapping[str, Any]) -> "_LoadPlan":
        """Check ``state_dict`` against ``opt``'s param groups and parameters; ValueError at the first mismatch."""
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(f"{_LOAD}: a state dict holds 'state' and 'param_groups', got {got}")
        groups, state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(state, Mapping) or not isinstance(groups, (list, tuple)) or not all(
                isinstance(g, Mapping) and "params" in g for g in groups):
            raise ValueError(f"{_LOAD}: 'state' must map parameter indices to their state and 'param_groups' be a "
                             f"list of dicts with 'params', got {type(state).__name__} and {type(groups).__name__}")
        if len(groups) != len(opt.param_groups):
            raise ValueError(f"{_LOAD}: {len(groups)} param groups saved, {len(opt.param_groups)} here")
        index = {id(p): i for i, p in enumerate(opt._flat_params())}
        placed: dict[Any, tuple[int, int, torch.Tensor]] = {}  # saved index -> (group, position, parameter)
        hyper, steps, group_step = [], {}, set()
        for gi, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
            saved_params = list(saved["params"])
            if len(saved_params) != len(mine["params"]):
                raise ValueError(f"{_LOAD}: a param group's size differs from the saved one (param group {gi}: "
                                 f"{len(saved_params)} parameters saved, {len(mine['params'])} here)")
            _refuse_unsupported(saved, f"in saved param group {gi}")
            step = _checked_step(saved["step"], f"param group {gi}") if saved.get("step") is not None else None
            for pj, (idx, p) in enumerate(zip(saved_params, mine["params"])):
                if idx in placed:
                    g0, p0, _ = placed[idx]
                    raise ValueError(f"{_LOAD}: saved parameter index {idx!r} is listed twice (param group {g0}, "
                                     f"parameter {p0} and param group {gi}, parameter {pj})")
                placed[idx] = (gi, pj, p)
                if step is not None:
                    steps[index[id(p)]] = step
                    group_step.add(index[id(p)])
            # a class (HybridDeviceOptimizer's optimizer-class knobs, in checkpoints saved before they were
            # kept as None) is not taken back: torch.load(weights_only=True) could not load a later save
            hyper.append({k: v for k, v in saved.items()
                          if k not in ("params", "step", "peakflat_gpu_fraction") and not isinstance(v, type)})
        copies = []
        for idx, st in state.items():
            if idx not in placed:
                raise ValueError(f"{_LOAD}: the saved state holds parameter index {idx!r}, which no saved param "
                                 f"group lists (they list {len(placed)} parameters)")
            gi, pj, p = placed[idx]
            where = f"param group {gi}, parameter {pj} (saved index {idx!r})"
            if not isinstance(st, Mapping):
                raise ValueError(f"{_LOAD}: {where}: its saved state is a {type(st).__name__}, not a dict")
            for key in _STATE_TENSORS:
                if st.get(key) is not None:
                    copies.append((index[id(p)], key, _check_state_tensor(st[key], key, p, f"{_LOAD}: {where}",
                                                                          "saved")))
            # A group's step wins: ours writes one only where every parameter shares it, and Megatron's
            # DistributedOptimizer with TE or apex present saves only the group's and hands back, as
            # per-parameter state, what this optimizer held before the load (step 0).
            if "step" in st and index[id(p)] not in group_step:
                steps[index[id(p)]] = _checked_step(st["step"], where)
        extra = state_dict.get("peakflat") or {}
        fraction = extra.get("gpu_fraction", groups[0].get("peakflat_gpu_fraction") if groups else None)
        measured = extra.get("measured", [])
        try:
            fraction = None if fraction is None else float(fraction)
        except (TypeError, ValueError):
            raise ValueError(f"{_LOAD}: the saved engine split gpu_fraction={fraction!r} is not a number") from None
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{_LOAD}: the saved engine split gpu_fraction={fraction} lies outside [0, 1]")
        measured = [tuple(m) for m in measured]
        if any(len(m) != 4 or not all(isinstance(x, (int, float)) for x in m) for m in measured):
            raise ValueError(f"{_LOAD}: the saved engine measurements {measured!r} are not rows of (GPU buckets, "
                             f"GPU seconds, host buckets, host seconds)")
        return _LoadPlan(hyper, steps, copies, fraction, measured)


class OffloadStreamAdamW(torch.optim.Optimizer):
    """AdamW with pinned host state, streamed through GPU staging slots and/or updated on the host cores.

    Args:
        params: parameters or param groups (as torch.optim).
        lr, betas, eps, weight_decay: AdamW hyperparameters (per group overridable).
        bucket: parameters per bucket; the GPU engine holds ``slots`` x ``bucket`` x 16 bytes.
        engine: 'gpu', 'cpu' or 'auto' (split buckets between both so they finish together,
            measured in the first steps; the split is saved in ``state_dict``). The two kernels round a
            few parameters' last bit differently, so 'auto', whose split follows the measured speed,
            does not repeat bit for bit from run to run (a resumed run does: it keeps the saved split).
        slots: GPU staging slots (2 or 3; no more than there are buckets); the CPU engine uses as many host slots.
        host_threads: threads of the host kernel (None: this rank's share of its cores, i.e. the
            cores it may run on divided by LOCAL_WORLD_SIZE).
        host_kernel: 'auto' (native if built, else torch), 'native' (error if not built) or 'torch'.
        stream_engine: who issues the GPU engine's uploads and write-backs: 'native' (the extension's
            ``BucketStreamer``, C++ streams and events; needs the extension built with CUDA, GPU params and
            pinned host state), 'torch' (Python streams and events) or 'auto' (native where it can run).
            Both give bitwise-equal results; ``stats`` records which one ran.
        pin: pin the host state (falls back to pageable with a warning when pinning fails).
        **extra_defaults: kept in ``defaults`` untouched (Megatron passes HybridDeviceOptimizer's knobs).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, bucket: int = 50_000_000,
                 engine: Literal["auto", "gpu", "cpu"] = "auto", slots: int = 3, host_threads: int | None = None,
                 host_kernel: Literal["auto", "native", "torch"] = "auto", pin: bool = True,
                 stream_engine: Literal["auto", "native", "torch"] = "auto", **extra_defaults: Any):
        if not 0.0 <= lr:
            raise ValueError(f"OffloadStreamAdamW: lr must be >= 0, got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"OffloadStreamAdamW: eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"OffloadStreamAdamW: betas must be in [0, 1), got {betas}")
        if engine not in ("auto", "gpu", "cpu"):
            raise ValueError(f"OffloadStreamAdamW: engine must be 'auto', 'gpu' or 'cpu', got {engine!r}")
        if slots not in (2, 3):
            raise ValueError(f"OffloadStreamAdamW: slots must be 2 or 3, got {slots}")
        if int(bucket) < 1:
            raise ValueError(f"OffloadStreamAdamW: bucket must be >= 1 parameter, got {bucket}")
        if host_kernel not in ("auto", "native", "torch"):
            raise ValueError(f"OffloadStreamAdamW: host_kernel must be 'auto', 'native' or 'torch', got {host_kernel!r}")
        if stream_engine not in ("auto", "native", "torch"):
            raise ValueError(f"OffloadStreamAdamW: stream_engine must be 'auto', 'native' or 'torch', got {stream_engine!r}")
        _refuse_unsupported(extra_defaults, "in the defaults")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **extra_defaults)
        torch.optim.Optimizer.__init__(self, params, defaults)  # explicit: subclasses may mix in other optimizers
        self.bucket, self.engine, self.slots = int(bucket), engine, slots
        self.host_threads = host_threads if host_threads is not None else _default_host_threads()
        self.host_kernel, self.pin = host_kernel, pin
        from .. import _ext

        if host_kernel == "native":
            self._ext = _ext.require("OffloadStreamAdamW(host_kernel='native')")
        else:
            self._ext = _ext.load() if host_kernel == "auto" else None
        self.stream_engine = stream_engine
        self._stream_ext = None
        if stream_engine == "native":
            self._stream_ext = _ext.require("OffloadStreamAdamW(stream_engine='native')")
            if not getattr(self._stream_ext, "with_cuda", False):
                raise _ext.ExtensionMissingError(
                    "OffloadStreamAdamW(stream_engine='native') needs megatron_peakflat._C built with CUDA; this one "
                    "is C++ only. Rebuild it where nvcc and a GPU are visible (`python setup.py build_ext --inplace`, "
                    "or PEAKFLAT_CUDA=1 to force), or pass stream_engine='torch'.")
        elif stream_engine == "auto":
            self._stream_ext = _ext.load()
        self._streamer = None
        self._materialized = False
        self._gpu_fraction: float | None = _FIXED_GPU_FRACTION.get(engine)
        self._measured: list[tuple[int, float, int, float]] = []
        self._step_tensors: dict[int, torch.Tensor] = {}
        # The host state is allocated at the first step; until then it is promised, so that a budget sized
        # from MemAvailable in between (SCO's boundary pool, in the first forward) leaves room for it.
        self._host_owner = f"OffloadStreamAdamW@{id(self):x}"
        weakref.finalize(self, host.settle, self._host_owner)
        self._promise_host()

    def _host_need(self, n: int, max_bucket: int, n_slots: int) -> int:
        """Host bytes of the state of ``n`` parameters: fp32 master and moments, plus the host kernel's
        staging slots unless the engine is 'gpu', plus alignment."""
        out_itemsize = self._out_dtype().itemsize
        host_slot_bytes = n_slots * max_bucket * (4 + out_itemsize) if self.engine != "gpu" else 0
        return 3 * 4 * n + host_slot_bytes + 256 * (4 + 2 * n_slots)

    def _promise_host(self) -> None:
        n = sum(p.numel() for p in self._flat_params())
        buckets = max(1, -(-n // self.bucket)) if n else 1
        host.promise(self._host_owner, self._host_need(n, min(self.bucket, max(1, n)), min(self.slots, buckets)))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch.optim, but views are accepted: Megatron hands over fp32 shards that are views of the
        parameter buffer (non-leaf tensors). Nothing here differentiates through them."""
        if self.__dict__.get("_materialized"):
            raise RuntimeError("OffloadStreamAdamW: param groups cannot be added after the host state exists")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"OffloadStreamAdamW: params must be tensors, got {type(p).__name__}")
            if not p.is_floating_point():
                raise ValueError(f"OffloadStreamAdamW: params must be floating point, got {p.dtype}")
        group = dict(param_group, params=params)
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        _refuse_unsupported(group, f"in param group {len(self.param_groups)}")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in params) or len({id(p) for p in params}) != len(params):
            raise ValueError("OffloadStreamAdamW: a parameter appears in more than one param group")
        self.param_groups.append(group)
        if "_host_owner" in self.__dict__:  # a group added after construction grows the promise
            self._promise_host()

    # ----------------------------------------------------------------------------------------------
    # layout and allocation

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _materialize(self) -> None:
        if self._materialized:
            return
        params = self._flat_params()
        if len({id(p) for p in params}) != len(params):
            raise ValueError("OffloadStreamAdamW: a parameter appears in more than one param group")
        groups = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._layout: Layout = plan_layout([p.numel() for p in params], groups, self.bucket)
        self._params = params
        for p in params:
            if not p.is_contiguous():
                raise ValueError(f"OffloadStreamAdamW: parameters must be contiguous, got one of shape {tuple(p.shape)} "
                                 f"with strides {p.stride()}")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"OffloadStreamAdamW: all parameters must be on one device, got {sorted(map(str, devices))}")
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        n, B = self._layout.total, max(1, self._layout.max_bucket)
        out_dtype = self._out_dtype()
        grad_dtype = torch.float32
        # bucket i goes through slot i mod slots: with fewer buckets than slots, the rest would never be used
        self._n_slots = min(self.slots, max(1, len(self._layout.buckets)))
        need = self._host_need(n, B, self._n_slots)
        check_host_budget(need, what=f"{n:,} parameters (fp32 master, exp_avg, exp_avg_sq) and staging",
                          owner=self._host_owner)
        self._region = HostRegion(need, pin=self.pin and self.device.type == "cuda", ext=self._ext)
        host.settle(self._host_owner)  # MemAvailable shows it from here on
        self._master = self._region.carve(n, torch.float32)
        self._exp_avg = self._region.carve(n, torch.float32)
        self._exp_avg_sq = self._region.carve(n, torch.float32)
        self._host_slots = [HostSlot(self._region.carve(B, grad_dtype), self._region.carve(B, out_dtype))
                            for _ in range(self._n_slots)] if self.engine != "gpu" else []
        self._gpu_slots: list[Slot] = []
        self._streams = Streams(self.device)
        self.stream_impl = self._pick_stream_impl()
        self._steps = [0] * len(params)
        with torch.no_grad():
            for i, p in enumerate(params):
                self._view(self._master, i).copy_(p.detach().reshape(-1))
        for i, p in enumerate(params):
            self._bind_state(i, p)
        self._materialized = True
        stats.record("optimizer", "host_bytes", need)
        stats.record("optimizer", "host_pinned", self._region.pinned)
        stats.record("optimizer", "host_backend", self._region.backend)
        stats.record("optimizer", "buckets", len(self._layout.buckets))
        stats.record("optimizer", "params", n)
        nb = len(self._layout.buckets)
        log.info("peakflat optimizer: OffloadStreamAdamW holds %s parameters in %d bucket%s of <= %s (%d staging slot%s%s), "
                 "%s of %s host memory (%s), engine=%s, host kernel=%s, stream engine=%s", f"{n:,}",
                 nb, "" if nb == 1 else "s", f"{B:,}", self._n_slots, "" if self._n_slots == 1 else "s",
                 f" of --peakflat-optimizer-slots {self.slots}: no more than buckets" if self._n_slots < self.slots else "",
                 format_bytes(need),
                 "pinned" if self._region.pinned else "pageable", self._region.backend, self.engine,
                 "native" if self._ext is not None else "torch", self.stream_impl, extra={"per_rank": True})

    def _pick_stream_impl(self) -> str:
        """'native' when the extension's BucketStreamer can run here (CUDA build, GPU params, pinned host
        state), else 'torch'; ValueError naming the missing piece when stream_engine='native' was asked."""
        if self.stream_engine == "torch":
            return "torch"
        why = ""
        if self._stream_ext is None or not getattr(self._stream_ext, "with_cuda", False):
            why = "megatron_peakflat._C is not built with CUDA"
        elif self.device.type != "cuda":
            why = f"the parameters are on {self.device}, not a GPU"
        elif not self._region.pinned:
            why = f"the host state is not pinned ({self._region.pin_error})"
        if why and self.stream_engine == "native":
            raise ValueError(f"OffloadStreamAdamW(stream_engine='native'): {why}; pass stream_engine='torch' or 'auto'")
        return "torch" if why else "native"

    def _out_dtype(self) -> torch.dtype:
        dts = {p.dtype for g in self.param_groups for p in g["params"]}
        return dts.pop() if len(dts) == 1 and next(iter(dts)) in (torch.float32, torch.bfloat16) else torch.float32

    def _flat_state(self) -> dict[str, torch.Tensor]:
        """The flat host buffer behind each tensor key of ``state[param]``."""
        return {"master_param": self._master, "exp_avg": self._exp_avg, "exp_avg_sq": self._exp_avg_sq}

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self._layout.offsets[i], self._layout.numels[i]
        return flat[off:off + n]

    def _bind_state(self, i: int, p: torch.Tensor) -> None:
        shape = p.shape
        self.state[p] = {
            "step": torch.tensor(float(self._steps[i]), dtype=torch.float32),
            "exp_avg": self._view(self._exp_avg, i).view(shape),
            "exp_avg_sq": self._view(self._exp_avg_sq, i).view(shape),
            "master_param": self._view(self._master, i).view(shape),
        }

    def _gpu_slot_list(self) -> list[Slot]:
        if not self._gpu_slots:
            B = max(1, self._layout.max_bucket)
            self._gpu_slots = [Slot(B, self.device) for _ in range(self._n_slots)]
            stats.record("optimizer", "gpu_staging_bytes", self._gpu_staging_bytes())
            if self.device.type == "cuda":
                # The allocator may hand the slots blocks that kernels queued on this stream still use; the
                # uploads run on a side stream that waits for nothing of this one yet. Once, at the first step.
                torch.cuda.current_stream(self.device).synchronize()
        return self._gpu_slots

    def _bucket_streamer(self):
        """The extension's BucketStreamer for this device (built once), or None for the torch streams."""
        if self.stream_impl != "native":
            return None
        if self._streamer is None:
            self._streamer = NativeStreamer(self._stream_ext, self.slots, self.device.index)
        return self._streamer

    def _step_tensor(self, step: int) -> torch.Tensor:
        t = self._step_tensors.get(step)
        if t is None:
            t = self._step_tensors[step] = torch.full((), float(step), dtype=torch.float32, device=self.device)
        return t

    def _gpu_staging_bytes(self) -> int:
        """Bytes of the GPU staging slots this optimizer holds (0 before its first step)."""
        return sum(t.numel() * t.element_size() for sl in getattr(self, "_gpu_slots", None) or ()
                   for t in (sl.state, sl.grad))

    # ----------------------------------------------------------------------------------------------
    # the step

    @torch.no_grad()
    @region("optimizer")
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step of every parameter that has a gradient (``decoupled_grad``, else ``grad``).

        On return the host masters and moments are updated, ``state[p]["step"]`` counts the steps
        each parameter took, and every model parameter holds its new master (cast to its dtype);
        the caller's CUDA stream is ordered after those copies. Returns ``closure()``'s value, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        meter.add_resident("optimizer", self._gpu_staging_bytes())  # slots kept from earlier steps
        self._materialize()
        self._sync_hdo_state_to_sub_optimizers()
        self._step_tensors.clear()  # one device scalar per distinct step value, for this step only
        params = self._params
        has_grad = []
        for p in params:
            g = getattr(p, "decoupled_grad", None)
            g = p.grad if g is None else g
            if g is not None and g.is_sparse:
                raise RuntimeError("OffloadStreamAdamW does not support sparse gradients")
            has_grad.append(g is not None)
        for i, h in enumerate(has_grad):
            if h:
                self._steps[i] += 1
        hyper = [GroupHyper(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
                            float(g["weight_decay"])) for g in self.param_groups]
        buckets = self._layout.buckets
        frac = self._current_fraction()
        n_gpu = min(len(buckets), max(0, round(frac * len(buckets))))
        if self._gpu_fraction is None and len(buckets) > 1:  # measuring: both engines need buckets
            n_gpu = min(len(buckets) - 1, max(1, n_gpu))
        gpu_b, cpu_b = buckets[:n_gpu], buckets[n_gpu:]
        t0 = time.perf_counter()
        start = self._streams.event()
        worker = None
        if cpu_b:
            worker = CpuEngineWorker(cpu_b, params=params, steps=self._steps, has_grad=has_grad, hyper=hyper,
                                     master=self._master, exp_avg=self._exp_avg, exp_avg_sq=self._exp_avg_sq,
                                     slots=self._host_slots, streams=self._streams, start_event=start,
                                     threads=self.host_threads, ext=self._ext,
                                     impl="torch" if self.host_kernel == "torch" else "auto")
            worker.start(background=bool(gpu_b))
        gpu_done: list = []
        t_gpu = 0.0
        try:
            if gpu_b:
                gpu_done = run_gpu_engine(gpu_b, params=params, steps=self._steps, has_grad=has_grad, hyper=hyper,
                                          master=self._master, exp_avg=self._exp_avg, exp_avg_sq=self._exp_avg_sq,
                                          slots=self._gpu_slot_list(), streams=self._streams,
                                          step_tensor=self._step_tensor, native=self._bucket_streamer())
                for ev in gpu_done[-self.slots:]:
                    Streams.sync(ev)
                t_gpu = time.perf_counter() - t0
        finally:
            if worker is not None:
                worker.join()  # also when the GPU engine failed: never leave the host thread running
        if worker is not None and self._streams.cuda:
            for ev in worker.done[-self.slots:]:
                torch.cuda.current_stream().wait_event(ev)  # params are uploaded before anyone reads them
                Streams.sync(ev)
        t_all = time.perf_counter() - t0
        for i, p in enumerate(params):
            self.state[p]["step"].fill_(float(self._steps[i]))
        if self.engine == "auto":
            self._record_split(len(gpu_b), t_gpu, len(cpu_b), worker.seconds if worker else 0.0)
        stats.record("optimizer", "step_ms", round(t_all * 1e3, 3))
        stats.record("optimizer", "gpu_buckets", len(gpu_b))
        stats.record("optimizer", "cpu_buckets", len(cpu_b))
        return loss

    def set_engine(self, engine: Literal["auto", "gpu", "cpu"]) -> None:
        """Switch the engine between steps; the state stays where it is ('auto' measures again).
        Switching to 'cpu' or 'auto' needs host staging, which an optimizer built with 'gpu' does not have."""
        if engine not in ("auto", "gpu", "cpu"):
            raise ValueError(f"OffloadStreamAdamW.set_engine: engine must be 'auto', 'gpu' or 'cpu', got {engine!r}")
        if engine != "gpu" and self._materialized and not self._host_slots:
            raise ValueError("OffloadStreamAdamW.set_engine: built with engine='gpu', it has no host staging; "
                             "build it with engine='auto' to switch between engines")
        self.engine = engine
        self._gpu_fraction = _FIXED_GPU_FRACTION.get(engine)
        self._measured = []

    def _current_fraction(self) -> float:
        if self._gpu_fraction is not None:
            return self._gpu_fraction
        return 0.5 if not self._measured else self._measured_fraction()

    def _measured_fraction(self) -> float:
        # the first step pays one-time costs (slot allocation, first kernel launches): drop it when others exist
        measured = self._measured[1:] if len(self._measured) > 1 else self._measured
        rate_g = sum(n for n, t, _, _ in measured if n and t) / max(1e-9, sum(t for n, t, _, _ in measured if n and t))
        rate_c = sum(n for _, _, n, t in measured if n and t) / max(1e-9, sum(t for _, _, n, t in measured if n and t))
        if rate_g + rate_c <= 0:
            return 0.5
        return rate_g / (rate_g + rate_c)

    def _record_split(self, n_gpu: int, t_gpu: float, n_cpu: int, t_cpu: float) -> None:
        if self._gpu_fraction is not None:
            return
        self._measured.append((n_gpu, t_gpu, n_cpu, t_cpu))
        if len(self._measured) >= _AUTO_MEASURE_STEPS:
            self._gpu_fraction = self._measured_fraction()
            stats.record("optimizer", "auto_gpu_fraction", round(self._gpu_fraction, 4))
            log.info("peakflat optimizer: engine=auto sends %.1f%% of the buckets of its %s parameters through the "
                     "GPU, the rest to the host kernel (measured over %d steps)", 100 * self._gpu_fraction,
                     f"{self._layout.total:,}", len(self._measured), extra={"per_rank": True})

    # ----------------------------------------------------------------------------------------------
    # Megatron's HybridDeviceOptimizer contract

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimizer does all the work (Megatron iterates this list)."""
        return [self]

    def dummy_step(self) -> None:
        """Materialise the state (zero moments, masters from the params) without changing anything."""
        self._materialize()

    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        """Adopt the tensors that callers put into ``state[param]`` (a checkpoint load writes the masters and
        moments there) into the buckets.

        The step count is not adopted: it comes from ``load_state_dict`` (from the parameter's saved param
        group when that carries one, else per parameter) and from ``step``. Megatron's DistributedOptimizer
        writes into ``state[param]["step"]`` the value its sharded-state template held before the load
        (``load_parameter_state_from_dp_reshardable`` hands ``_set_main_param_and_optimizer_states`` the
        template's 0), after it has loaded the real step through ``load_state_dict``; adopting it would
        restart Adam's bias correction on every resume. A ``step`` entry that disagrees with the count is
        replaced by it.

        All or nothing, as ``load_state_dict``: a tensor that is not of its parameter's shape (or not real
        floating point) raises a ValueError naming the param group, the parameter and both shapes before
        any tensor is adopted."""
        if not self._materialized:
            return
        flats = self._flat_state()
        where = [(gi, pj) for gi, g in enumerate(self.param_groups) for pj in range(len(g["params"]))]
        adopt, rebind = [], set()
        for i, p in enumerate(self._params):
            st = self.state.get(p)
            if st is None:
                rebind.add(i)
                continue
            for k, flat in flats.items():
                v = st.get(k)
                dst = self._view(flat, i)
                if v is None:
                    rebind.add(i)
                elif isinstance(v, torch.Tensor) and v.data_ptr() == dst.data_ptr() and v.numel() == dst.numel():
                    if v.shape != p.shape:  # the bucket's own view, reshaped
                        rebind.add(i)
                else:
                    at = (f"OffloadStreamAdamW: adopting state[param] (a checkpoint load), param group {where[i][0]}, "
                          f"parameter {where[i][1]}")
                    v = _check_state_tensor(torch.as_tensor(v), k, p, at, "the tensor put in for")
                    adopt.append((dst, v.detach().clone() if _overlaps(v, flats.values()) else v))
                    rebind.add(i)
        with torch.no_grad():
            for dst, v in adopt:
                dst.copy_(v.reshape(-1))
        for i, p in enumerate(self._params):
            if i in rebind or not self._step_is_current(i, p):
                self._bind_state(i, p)

    def _step_is_current(self, i: int, p: torch.Tensor) -> bool:
        """Whether ``state[p]["step"]`` is a tensor holding parameter i's step count."""
        s = self.state.get(p, {}).get("step")
        return isinstance(s, torch.Tensor) and float(s) == float(self._steps[i])

    def update_fp32_param_by_new_param(self) -> None:
        """Reload the fp32 masters from the model parameters (Megatron calls this after loading weights only)."""
        if not self._materialized:
            return
        with torch.no_grad():
            for i, p in enumerate(self._params):
                self._view(self._master, i).copy_(p.detach().reshape(-1))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim, for ``decoupled_grad`` (Megatron's precision-aware path) as well as ``grad``."""
        super().zero_grad(set_to_none)
        for g in self.param_groups:
            for p in g["params"]:
                if getattr(p, "decoupled_grad", None) is not None:
                    if set_to_none:
                        p.decoupled_grad = None
                    else:
                        p.decoupled_grad.zero_()

    # ----------------------------------------------------------------------------------------------
    # checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch.optim layout: ``state`` by parameter index, ``param_groups`` with indices (and the step)."""
        self._materialize()
        self._sync_hdo_state_to_sub_optimizers()
        index = {id(p): i for i, p in enumerate(self._params)}
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [index[id(p)] for p in g["params"]]
            steps = {self._steps[index[id(p)]] for p in g["params"]}
            if len(steps) == 1:
                d["step"] = steps.pop()
            # in each group, because Megatron's DistributedOptimizer keeps only param_groups and state
            d["peakflat_gpu_fraction"] = self._gpu_fraction
            groups.append(d)
        state = {i: dict(self.state[p]) for i, p in enumerate(self._params)}
        return {"state": state, "param_groups": groups,
                "peakflat": {"gpu_fraction": self._gpu_fraction, "measured": list(self._measured)}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` (ours, or torch.optim.AdamW's without ``master_param``: masters then
        come from the current parameters). Tensors are copied into the host buckets. A parameter's Adam
        step is its saved param group's ``step`` when the group has one, else its own saved ``step``.

        All or nothing: every param group, parameter and state tensor is checked first (group count and
        sizes, as torch.optim does, and also each tensor's shape, element count and dtype against the
        parameter it lands on, which torch.optim only meets at the next step as a broadcast error or a
        silent broadcast). A ValueError names the param group, the parameter and both shapes, and leaves
        the optimizer (hyperparameters, step counts, masters, moments, engine split) exactly as it was."""
        load = _LoadPlan.check(self, state_dict)
        self._materialize()
        flats = self._flat_state()
        for mine, hyper in zip(self.param_groups, load.hyper):
            mine.update(hyper)
        staged = []
        for i, key, src in load.copies:
            dst = self._view(flats[key], i)
            if src.data_ptr() != dst.data_ptr():
                # a view of another place in the buckets (this optimizer's own state, reordered) is read first
                staged.append((dst, src.detach().clone() if _overlaps(src, flats.values()) else src))
        with torch.no_grad():
            for dst, src in staged:
                dst.copy_(src.reshape(-1))
        for i, step in load.steps.items():
            self._steps[i] = step
        for i, p in enumerate(self._params):  # views of the buckets, and each step (its group's or its own)
            self._bind_state(i, p)
        if self.engine == "auto" and load.fraction is not None:
            self._gpu_fraction = load.fraction  # the split the saved run used: a resumed run continues bitwise
            self._measured = load.measured
