"""PipelinedLLEP in Megatron: a token dispatcher whose routed-experts step is one chunked autograd call.

Two registry entries:
- ``wrap_moe_layer_init`` wraps ``MoELayer.__init__``: after Megatron built its alltoall dispatcher,
  the layer gets a ``PeakflatDispatcher`` when ``--peakflat-dispatch pipelined-llep`` is on (the
  config value stays ``alltoall``), and ``set_shared_experts`` is called again under shared-expert overlap;
- ``wrap_routed_experts_compute`` wraps ``MoELayer.routed_experts_compute``: for a layer holding a
  PeakflatDispatcher it runs dispatch -> experts -> combine for all chunks in one autograd Function
  (``dispatch.pipelined``), running the layer's own experts on each chunk.

The dispatcher's other steps are cheap pass-throughs (reshape in, reshape out, shared experts
added at the end), so MoELayer.forward, the router, its aux losses and expert bias, and
``--recompute-modules moe`` all run unchanged.

The experts are Megatron's ``SequentialMLP`` (local or TE linear layers) or ``TEGroupedMLP``
(Transformer Engine's GroupedLinear, ``--moe-grouped-gemm`` on the TE spec); PipelinedLLEP runs
their math on their weights (``ExpertMath``) and adds the weight gradients into ``main_grad``
itself, so gradient-accumulation fusion changes nothing for it.

Handed back to Megatron's own dispatcher, with one logged reason per layer kind (``unsupported_reason``),
for: a dispatcher type other than alltoall, other expert modules, expert tensor parallelism,
pad-to-capacity, router padding for quantization, fp8/fp4, latent MoE, expert biases, CUDA graphs,
delayed/overlapped wgrad, TE's op fuser or activation modules, and the inference-optimized
transformer. The start-up check rejects the flags behind these before the model is built.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
from torch.func import functional_call

from .. import stats
from ..dispatch.api import llep_moe
from ..dispatch.bound import overlap_on, segment_piece_rows
from ..dispatch.grouped import GroupedExperts, grouped_supported, pack_expert_weights
from ..dispatch.config import DispatchConfig, resolve_membership
from . import dispatch_recompute, state
from .logs import info_once

__all__ = ["wrap_moe_layer_init", "wrap_routed_experts_compute", "PeakflatDispatcher", "ExpertMath",
           "SequentialMLPBank", "GroupedLinearBank", "make_bank", "grouped_linear_reason", "unsupported_reason"]


def _plain_linear_types() -> tuple[type, ...]:
    """Linear modules whose forward is ``x @ weight.T`` for a bias-free expert at expert TP=1: Megatron's
    own, and Transformer Engine's wrappers of them when TE is importable (the NGC default spec)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    types: list[type] = [ColumnParallelLinear, RowParallelLinear]
    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except ImportError:  # pragma: no cover - depends on the Megatron build
        te_ext = None
    for name in ("TEColumnParallelLinear", "TERowParallelLinear", "TELinear"):
        t = getattr(te_ext, name, None)
        if isinstance(t, type):
            types.append(t)
    return tuple(types)


def _activation_reason(c: Any) -> str | None:
    """Why the experts' activation is not one ``ExpertMath.elementwise`` reproduces (None: it is)."""
    if getattr(c, "use_te_activation_func", False):
        return "use_te_activation_func (Transformer Engine activation modules)"
    if c.bias_activation_fusion:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        if not c.gated_linear_unit or c.activation_func not in (torch.nn.functional.silu, quick_gelu):
            return "bias_activation_fusion without swiglu/quick-geglu"
    return None


def _plain_mlp_reason(experts: Any) -> str | None:
    """Why the SequentialMLP experts' math cannot be run as plain torch ops on their weights (None: it can)."""
    c = experts.config
    mlp = experts.local_experts[0]
    allowed = _plain_linear_types()
    if type(mlp.linear_fc1) not in allowed or type(mlp.linear_fc2) not in allowed:
        return f"linear layers {type(mlp.linear_fc1).__name__}/{type(mlp.linear_fc2).__name__}"
    if [n for n, _ in mlp.named_parameters()] != ["linear_fc1.weight", "linear_fc2.weight"]:
        return "expert parameters other than two weights"
    for attr in ("add_bias_linear", "fp8", "fp4"):
        if getattr(c, attr, None):
            return attr
    if (why := _activation_reason(c)) is not None:
        return why
    if getattr(c, "_cpu_offloading_context", None) is not None:
        return "cpu offloading"
    if (getattr(c, "expert_tensor_parallel_size", 1) or 1) != 1:
        return "expert tensor parallelism"
    from megatron.core.utils import get_pg_size

    for lin in (mlp.linear_fc1, mlp.linear_fc2):
        group = getattr(lin, "tp_group", None)
        if group is not None and get_pg_size(group) != 1:
            return "expert tensor parallelism"
    return None


def grouped_linear_reason(experts: Any) -> str | None:
    """Why Megatron's TEGroupedMLP ``experts`` cannot run as PipelinedLLEP's bank (None: they can).

    Needs Transformer Engine's GroupedLinear layout: ``linear_fc1`` / ``linear_fc2`` each holding
    one [out, in] ``weight{i}`` per local expert and nothing else, and the unfused forward of
    ``TEGroupedMLP.forward`` (no op fuser, no TE activation module, no interleaved GLU). Biases and
    fp8/fp4, refused for every expert kind, are ``unsupported_reason``'s checks.
    """
    c = experts.config
    n = experts.num_local_experts
    if getattr(experts, "_with_fused_impl", False):
        return "use_transformer_engine_op_fuser (TE's fused grouped MLP)"
    for attr, what in (("moe_single_grouped_weight", "moe_single_grouped_weight"),
                       ("moe_single_grouped_bias", "moe_single_grouped_bias"),
                       ("moe_mlp_glu_interleave_size", "moe_mlp_glu_interleave_size (interleaved GLU)")):
        if getattr(c, attr, None):
            return what
    if getattr(experts, "offload_expert_fc1", False) or getattr(experts, "offload_moe_act", False):
        return "fine-grained activation offloading of expert_fc1/moe_act"
    if (why := _activation_reason(c)) is not None:
        return why
    from megatron.core.utils import get_pg_size

    if experts.tp_group is not None and get_pg_size(experts.tp_group) != 1:
        return "expert tensor parallelism"
    want = [f"weight{i}" for i in range(n)]
    for name in ("linear_fc1", "linear_fc2"):
        lin = getattr(experts, name)
        got = [p for p, _ in lin.named_parameters()]
        if got != want:
            return f"{name} parameters {got[:3]}{'...' if len(got) > 3 else ''}, not weight0..weight{n - 1}"
        if len({tuple(getattr(lin, w).shape) for w in want}) != 1:
            return f"{name} weights of different shapes"
    return None


class ExpertMath(GroupedExperts):
    """The bias-free expert MLP of Megatron's experts as plain torch ops on given weights.

    ``elementwise`` is what ``MLP.forward`` (SequentialMLP's experts) and ``TEGroupedMLP.forward``
    do between fc1 and fc2: the activation or gated unit (with clamp and offset) and the per-token
    prob scale, or Megatron's weighted swiglu/quick-geglu fusion. With ``grouped``, a chunk's experts
    run as grouped GEMMs (``GroupedExperts``), else one expert at a time.
    """

    plain: bool = True
    fused_squared_relu: bool = False
    """TEGroupedMLP's weighted squared-ReLU kernel (``use_fused_weighted_squared_relu``)."""

    def __init__(self, experts: Any, params: list[list[torch.Tensor]], grouped: bool,
                 plain_reason: str | None = None) -> None:
        self.experts = experts
        self.config = experts.config
        self.num_local_experts = experts.num_local_experts
        self._params = params
        """[fc1, fc2] weights of each local expert."""
        self.plain_reason = plain_reason
        """Why the plain-ops path cannot run (None: it can)."""
        self.want_grouped = grouped
        """The flag's wish (--peakflat-dispatch-grouped-gemm); ``grouped`` adds what the experts allow."""

    @property
    def grouped(self) -> bool:  # type: ignore[override]
        """Grouped GEMMs: wanted, plain ops possible, and probs applied inside the MLP (not on its input)."""
        return self.want_grouped and self.plain and not self.config.moe_apply_probs_on_input

    def _plain(self, x: torch.Tensor, probs: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.elementwise(torch.nn.functional.linear(x, fc1), probs), fc2)

    def elementwise(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The experts' forward between fc1 and fc2: the activation (or gated unit) and the per-token prob scale."""
        c = self.config
        if c.bias_activation_fusion:  # the fused branch with a per-token scale
            from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            if c.activation_func == torch.nn.functional.silu:
                h = weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), c.activation_func_fp8_input_store)
            else:
                h = weighted_bias_quick_geglu_impl(h, None, probs.unsqueeze(-1), c.activation_func_fp8_input_store,
                                                   c.glu_linear_offset, c.activation_func_clamp_value)
            return h
        if self.fused_squared_relu:
            from megatron.core.fusions.fused_weighted_squared_relu import weighted_squared_relu_impl

            return weighted_squared_relu_impl(h, probs.unsqueeze(-1))
        if c.gated_linear_unit:
            a, b = torch.chunk(h, 2, dim=-1)
            if (val := c.activation_func_clamp_value) is not None:
                a = a.clamp(min=None, max=val)
                b = b.clamp(min=-val, max=val)
            h = c.activation_func(a) * (b + c.glu_linear_offset)
        else:
            h = c.activation_func(h)
        dtype = h.dtype
        return (h * probs.unsqueeze(-1)).to(dtype)

    def expert_params(self, local: int) -> list[torch.Tensor]:
        return self._params[local]

    def _module_call(self, li: int | None, w: Sequence[torch.Tensor] | None, xs: torch.Tensor, ps: torch.Tensor
                     ) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} runs plain ops only")

    def compute(self, x: torch.Tensor, probs: torch.Tensor, tokens_per_expert: Sequence[int],
                local: Sequence[int | None], weights: Sequence[Sequence[torch.Tensor] | None]) -> torch.Tensor:
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP.forward and TEGroupedMLP.forward do
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        # One split, not a slice per segment: the slice's backward writes a zero-filled [rows, H] gradient for
        # every segment, the split's one concatenation of the segments' gradients. A segment longer than
        # segment_piece_rows runs in pieces of it, so that skewed routing cannot enlarge one call's transients.
        piece = segment_piece_rows(x.shape[0], self.num_local_experts)
        calls = [(min(piece, int(n) - at), li, w) for n, li, w in zip(tokens_per_expert, local, weights)
                 for at in range(0, int(n), piece)]
        sizes = [c[0] for c in calls]
        rest = x.shape[0] - sum(sizes)
        xs_all, ps_all = torch.split(x, sizes + [rest]), torch.split(probs, sizes + [rest])
        outs = []
        for (_, li, w), xs, ps in zip(calls, xs_all, ps_all):
            if self.plain:
                w = self.expert_params(li) if li is not None else w
                y = self._plain(xs, ps, w[0], w[1])
            else:
                y = self._module_call(li, w, xs, ps)
            outs.append(y)
        if (extra := len(calls) - sum(int(n) > 0 for n in tokens_per_expert)) > 0:
            stats.add("dispatch", "expert_calls_split", extra)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class SequentialMLPBank(ExpertMath):
    """Megatron's SequentialMLP as an ExpertBank: the same expert MLP math, with own or received weights.

    ``plain=True`` (used when ``_plain_mlp_reason`` finds nothing against it) runs ``MLP.forward``'s
    math on the experts' weights (``ExpertMath``): the same GEMMs and elementwise ops without
    Megatron's per-call Python layers, which dominate when a chunk gives each expert few rows.
    Otherwise every segment calls the expert module itself.
    """

    def __init__(self, experts: Any, plain: bool | None = None, grouped: bool = True) -> None:
        super().__init__(experts, [list(m.parameters()) for m in experts.local_experts], grouped,
                         _plain_mlp_reason(experts))
        self._template = experts.local_experts[0]
        self._names = [n for n, _ in self._template.named_parameters()]
        self.plain = self.plain_reason is None if plain is None else plain

    def _module_call(self, li: int | None, w: Sequence[torch.Tensor] | None, xs: torch.Tensor, ps: torch.Tensor
                     ) -> torch.Tensor:
        if li is not None:
            y, _ = self.experts.local_experts[li](xs, ps)
        else:
            y, _ = functional_call(self._template, dict(zip(self._names, w)), (xs, ps))
        return y


class GroupedLinearBank(ExpertMath):
    """Megatron's TEGroupedMLP as an ExpertBank: expert i is ``linear_fc1.weight{i}`` and
    ``linear_fc2.weight{i}`` (Transformer Engine's GroupedLinear layout), run with the math of
    ``TEGroupedMLP.forward`` (``ExpertMath``); TE's own grouped GEMM modules are not called, so the
    weights' gradients go where PipelinedLLEP puts them (``main_grad`` under Megatron's DDP), with
    or without gradient-accumulation fusion. Only configurations ``grouped_linear_reason`` accepts."""

    def __init__(self, experts: Any, grouped: bool = True) -> None:
        from megatron.core.activations import squared_relu

        super().__init__(experts, [[getattr(experts.linear_fc1, f"weight{i}"), getattr(experts.linear_fc2, f"weight{i}")]
                                   for i in range(experts.num_local_experts)], grouped)
        c = self.config
        self.fused_squared_relu = (not c.bias_activation_fusion and c.activation_func == squared_relu
                                   and bool(getattr(c, "use_fused_weighted_squared_relu", False)))


def _is_grouped_linear_mlp(experts: Any) -> bool:
    from megatron.core.transformer.moe.experts import InferenceGroupedMLP, TEGroupedMLP

    return isinstance(experts, TEGroupedMLP) and not isinstance(experts, InferenceGroupedMLP)


def make_bank(experts: Any, plain: bool | None = None, grouped: bool = True) -> ExpertMath:
    """The ExpertBank for a MoE layer's experts: TEGroupedMLP or SequentialMLP."""
    if _is_grouped_linear_mlp(experts):
        return GroupedLinearBank(experts, grouped=grouped)
    return SequentialMLPBank(experts, plain=plain, grouped=grouped)


def _dispatcher_base() -> type:
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    return MoETokenDispatcher


class PeakflatDispatcher:  # the real base (MoETokenDispatcher) is mixed in lazily by ``_make_dispatcher``
    """MoETokenDispatcher interface; the real work happens in ``run`` (from routed_experts_compute)."""

    def _setup(self, original: Any) -> None:
        base = _dispatcher_base()
        pgs = SimpleNamespace(ep=original.ep_group, expt_tp=original.tp_group, tp_ep=original.tp_ep_group)
        base.__init__(self, config=original.config, pg_collection=pgs)
        self.num_local_experts = original.num_local_experts
        self.local_expert_indices = original.local_expert_indices
        self.hidden_shape: torch.Size | None = None
        self.routing_map: torch.Tensor | None = None
        self._shared_input: torch.Tensor | None = None
        self.plain_experts: bool | None = None  # None: plain torch ops when the config allows (tests may force)

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = tokens.shape
        self.routing_map = routing_map
        if self.shared_experts is not None:
            self._shared_input = tokens
        return tokens.view(-1, tokens.shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Any:
        raise RuntimeError("PeakflatDispatcher runs dispatch and experts together in MoELayer.routed_experts_compute; "
                           "the megatron-peakflat patch of that method is missing (call megatron_peakflat.apply)")

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            # Shared-expert overlap: Megatron leaves the shared experts to the dispatcher.
            out = out + self.shared_experts(self._shared_input)
            self._shared_input = None
        self.routing_map = None
        return out

    def _resolved(self, cfg: DispatchConfig) -> DispatchConfig:
        """``cfg`` with 'auto' knobs set for this layer's router (cached while the config object lasts)."""
        if getattr(self, "_cfg_from", None) is not cfg:
            self._cfg_from, self._cfg = cfg, cfg.resolved(self.config.moe_router_topk)
        return self._cfg

    def run(self, hidden_states: torch.Tensor, probs: torch.Tensor, experts: Any) -> torch.Tensor:
        """Dispatch, experts and combine for all chunks: [T, H] rows in, [T, H] MoE output out."""
        cfg = self._resolved(state.current().dispatch)
        bank = getattr(self, "_bank", None)
        if bank is None or bank.experts is not experts:
            bank = self._bank = make_bank(experts, plain=self.plain_experts, grouped=cfg.grouped_gemm)
            if not bank.plain:
                info_once(f"peakflat dispatch: experts run through their modules ({bank.plain_reason or 'forced'})")
        bank.want_grouped = cfg.grouped_gemm
        if bank.grouped and not grouped_supported(hidden_states):
            info_once(f"peakflat dispatch: grouped GEMMs need bf16 on an sm80+ GPU (or CPU); {hidden_states.dtype} on "
                      f"{hidden_states.device.type} runs one expert at a time")
        use_grouped = bank.use_grouped(hidden_states)
        if use_grouped and not getattr(bank, "_packed", False):
            bank._packed = True
            moved = pack_expert_weights([bank.expert_params(i) for i in range(bank.num_local_experts)])
            if moved:
                info_once(f"peakflat dispatch: packed each MoE layer's {bank.num_local_experts} experts' weights into "
                          f"one buffer (once, {moved / 2**20:.1f} MiB per layer), so that grouped GEMMs read them "
                          "in place")
        stats.record("dispatch", "experts", "grouped" if use_grouped else "per-expert")
        group = self.ep_group if self.ep_size > 1 else None
        dispatch_recompute.record_call(self)
        out_grad = None
        if cfg.fuse_recompute and torch.is_grad_enabled() and dispatch_recompute.in_recompute():
            if self.config.hidden_dropout > 0:
                dispatch_recompute.disable(self, f"hidden_dropout={self.config.hidden_dropout} scales its output gradient")
            elif getattr(bank, "assumed_grad_mismatch", False):
                dispatch_recompute.disable(self, "its output gradient differed from the checkpoint's (corrected exactly)")
            else:
                out_grad = dispatch_recompute.known_output_grad(self, hidden_states)
        # Once a fused call of this layer found the assumed gradient exact, the recomputed output is known
        # to reach nothing but the checkpoint's output, whose values the recompute discards.
        need_output = out_grad is None or not getattr(bank, "assumed_grad_confirmed", False)
        if not need_output:
            info_once("peakflat dispatch: fused recompute confirmed the MoE output gradient; later recomputes "
                      "skip the MoE output, which only the checkpoint's discarded output reads")
        out = llep_moe(hidden_states, probs, self.routing_map, bank, group, cfg, out_grad=out_grad,
                       need_output=need_output)
        if not _FIRST_CALL_LOGGED:
            _log_first_call(hidden_states.shape[0], cfg, self.ep_size)
        return out


_FIRST_CALL_LOGGED = False


def _log_first_call(rows: int, cfg: Any, ep: int) -> None:
    """One line on the first MoE layer call: what the schedule chose, for runs whose log is all the user has."""
    global _FIRST_CALL_LOGGED
    _FIRST_CALL_LOGGED = True
    s = stats.snapshot()["dispatch"]
    overlap = "on" if overlap_on(cfg.overlap, cfg.overlap_min_chunks, s["chunks"], ep) else "off"
    if overlap == "on" and cfg.pack_collectives:
        overlap += f" (over {s.get('transport', cfg.transport)})"
    pieces = (f", experts one call at a time ({s.get('expert_calls_split', 0)} extra calls where an expert's rows "
              "passed its balanced share)") if s.get("experts") == "per-expert" else ""
    info_once(f"peakflat dispatch: first MoE layer call: {rows} tokens here, K={s.get('chunks')} chunks of at most "
              f"{s.get('max_chunk_rows')} rows, all-to-all overlap {overlap}, load imbalance {s.get('imbalance')}, "
              f"{s.get('spilled_experts', 0)} experts spilled so far, at most {s.get('max_foreign_experts', 0)} "
              f"experts of other ranks hosted per rank (--peakflat-dispatch-max-foreign-experts){pieces}",
              per_rank=True)


@functools.cache
def _make_dispatcher_class() -> type:
    return type("PeakflatDispatcher", (PeakflatDispatcher, _dispatcher_base()), {})


def make_dispatcher(original: Any) -> PeakflatDispatcher:
    """A PeakflatDispatcher on the process groups, config and local experts of Megatron's ``original``."""
    cls = _make_dispatcher_class()
    d = cls.__new__(cls)
    d._setup(original)
    return d


def unsupported_reason(layer: Any) -> str | None:
    """Why this MoELayer must keep Megatron's dispatcher, or None when PipelinedLLEP can run it.

    The start-up check (``config._check_against_megatron``) rejects the flags behind most of these
    reasons before the model is built; this is the net for models built through the API."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    c = layer.config
    if not isinstance(layer.token_dispatcher, MoEAlltoAllTokenDispatcher):
        return f"moe_token_dispatcher_type is {c.moe_token_dispatcher_type!r}, not 'alltoall'"
    experts = layer.experts
    if _is_grouped_linear_mlp(experts):
        if (why := grouped_linear_reason(experts)) is not None:
            return f"TEGroupedMLP experts: {why}"
    elif isinstance(experts, SequentialMLP):
        # Gradient-accumulation fusion writes main_grad inside the linear layers' backward. The plain path
        # never calls them (it adds into main_grad itself); experts run through their modules would
        # bypass PipelinedLLEP's weight-gradient routing, so only that path is refused.
        if getattr(c, "gradient_accumulation_fusion", False) and (why := _plain_mlp_reason(experts)) is not None:
            return f"gradient-accumulation fusion with experts run through their modules ({why})"
    else:
        return f"experts are {type(experts).__name__}; SequentialMLP and TEGroupedMLP are supported"
    if layer.token_dispatcher.tp_size > 1:
        return "expert tensor parallelism > 1"
    checks = [
        ("moe_pad_expert_input_to_capacity", "pad-to-capacity"),
        ("moe_router_padding_for_quantization", "router padding for quantization"),
        ("fp8", "fp8"), ("fp4", "fp4"),
        ("moe_latent_size", "latent MoE projections"),
        ("overlap_dispatch_backward_with_experts_wgrad", "dispatch/wgrad overlap"),
        ("delay_wgrad_compute", "delayed wgrad"),
        ("add_bias_linear", "expert biases"),
    ]
    for attr, what in checks:
        if getattr(c, attr, None):
            return what
    if getattr(c, "cuda_graph_impl", "none") not in (None, "none"):
        return "CUDA graphs"
    if getattr(c, "transformer_impl", None) == "inference_optimized":
        return "inference-optimized transformer"
    return None


def wrap_moe_layer_init(original_init: Callable[..., None]) -> Callable[..., None]:
    """MoELayer.__init__ that swaps in the PipelinedLLEP dispatcher when the config asks for it."""

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        cfg = state.get()
        if cfg is None or cfg.dispatch.impl != "pipelined-llep":
            return
        why = unsupported_reason(self)
        if why is not None:
            info_once(f"peakflat dispatch: MoE layer keeps Megatron's dispatcher: {why}")
            stats.add("dispatch", "handed_back_layers", 1)
            return
        original = self.token_dispatcher
        self.token_dispatcher = make_dispatcher(original)
        self.token_dispatcher.megatron_dispatcher = original  # kept for side-by-side benchmarks
        if self.shared_experts is not None and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        stats.add("dispatch", "layers", 1)
        ep = self.token_dispatcher.ep_size
        d = cfg.dispatch
        if ep == 1:
            overlap = "off (nothing travels at EP=1)"
        else:
            split = f"in calls the cap splits, cut into at least min({d.overlap_min_chunks}, 2K) chunks"
            overlap = "on" if d.overlap else (split if d.overlap_min_chunks else "off")
        info_once(f"peakflat dispatch: PipelinedLLEP on MoE layers (EP={ep}, "
                  f"c={d.describe_cap(self.config.moe_router_topk)}, max K={cfg.dispatch.max_chunks}, membership={resolve_membership(cfg.dispatch.membership)}, alpha={cfg.dispatch.alpha}, "
                  f"m={cfg.dispatch.min_spill}, lambda={cfg.dispatch.imbalance_threshold}, overlap={overlap})")

    return __init__


def wrap_routed_experts_compute(original: Callable[..., Any]) -> Callable[..., Any]:
    """MoELayer.routed_experts_compute that runs the chunked schedule for a PeakflatDispatcher layer."""

    @functools.wraps(original)
    def routed_experts_compute(self: Any, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[Any, Any]:
        if not isinstance(self.token_dispatcher, PeakflatDispatcher):
            return original(self, hidden_states, probs)
        return self.token_dispatcher.run(hidden_states, probs, self.experts), None

    return routed_experts_compute
