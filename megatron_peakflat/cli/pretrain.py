"""``python -m megatron_peakflat.pretrain``: Megatron's GPT/MoE pretraining with the peakflat patches.

Built on ``megatron.training`` from the megatron-core wheel, so no Megatron-LM checkout is needed.
It takes every ``pretrain_gpt.py`` flag plus the ``--peakflat-*`` flags. The order of start-up is
what makes bad input fail early:

1. Megatron parses and validates its flags and ours (``extra_args_provider=add_args``);
2. ``megatron_peakflat.apply(args)`` checks every peakflat value and combination, then patches;
3. only then does Megatron build the model, the optimizer and the data.

Users who keep their own ``pretrain_gpt.py`` make the same two-line change:
``parse_and_validate_args(extra_args_provider=extra_args_provider, ...)`` and then
``megatron_peakflat.apply(args)`` before ``pretrain(...)``.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Any, Callable, Iterator

import torch

import megatron_peakflat
from megatron_peakflat.auto import NOTHING_FITS, NothingFits
from megatron_peakflat.integration.attention import transformer_engine_available

log = logging.getLogger("megatron_peakflat")


def _flag_given(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _default_argv(argv: list[str]) -> list[str]:
    """Defaults that let Megatron build without Transformer Engine or apex, each logged; a flag the
    user passed always wins."""
    import importlib.util

    adds: list[tuple[str, tuple[str, ...]]] = []  # (what is missing, flags)
    if not transformer_engine_available():
        if not _flag_given(argv, "--transformer-impl"):
            adds.append(("Transformer Engine", ("--transformer-impl", "local")))
        if not _flag_given(argv, "--rope-fusion", "--no-rope-fusion"):
            adds.append(("Transformer Engine", ("--no-rope-fusion",)))
        if not _flag_given(argv, "--no-persist-layer-norm"):
            adds.append(("Transformer Engine", ("--no-persist-layer-norm",)))
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None and not _flag_given(
            argv, "--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion"):
        adds.append(("apex's fused_weight_gradient_mlp_cuda", ("--no-gradient-accumulation-fusion",)))
    for missing, flags in adds:
        log.info("peakflat: %s not found; adding %s", missing, " ".join(flags))
    return [*argv, *(a for _, flags in adds for a in flags)]


def extra_args_provider(parser: Any) -> Any:
    """``add_args`` plus a fix for help strings that break ``--help`` (a bare '%' in megatron-core 0.19.2)."""
    megatron_peakflat.add_args(parser)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                formatter._expand_help(action)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")
    return parser


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Sum of masked per-token losses and the token count, as Megatron's pretrain_gpt reports them."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask",
               "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")


def get_batch(data_iterator: Iterator, vp_stage: int | None) -> dict[str, Any] | None:
    """This rank's micro-batch: TP rank 0 reads it and broadcasts it to its TP group, then the
    sequence is split for context parallelism (the steps of Megatron's own GPT ``get_batch``)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    mtp_here = _mtp_on_this_rank(args, vp_stage)
    if not (is_first_or_last_pipeline_stage(vp_stage) or mtp_here):
        return None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {k: (raw[k].cuda(non_blocking=True) if raw.get(k) is not None else None) for k in _BATCH_KEYS}
    has_cu_seqlens = getattr(args, "sft", False) or getattr(args, "dataloader_inter_document_masking", False)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=has_cu_seqlens,
        is_hybrid_cp=args.hybrid_context_parallel,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=args.hybrid_context_parallel,
                                     cp_group=mpu.get_context_parallel_group())


def _mtp_on_this_rank(args: Any, vp_stage: int | None) -> bool:
    """Whether this pipeline rank holds MTP layers, which look up the tokens (Megatron's ``mtp_on_this_rank``:
    the last stage, or where --pipeline-model-parallel-layout puts them)."""
    if not getattr(args, "mtp_num_layers", None):
        return False
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    layout = args.pipeline_model_parallel_layout
    if isinstance(layout, str):
        layout = PipelineParallelLayerLayout.from_str(layout, args.pipeline_model_parallel_size)
    return mtp_on_this_rank(layout, args.mtp_num_layers, ignore_virtual=False, vp_stage=vp_stage)


def forward_step(data_iterator: Iterator, model: Any) -> tuple[torch.Tensor, Any]:
    """Megatron's GPT forward step. Ring-DTP enters through the patched ``GPTModel.forward``."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage")) or {}
    timers("batch-generator").stop()
    output = model(batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask"),
                   labels=batch.get("labels"), loss_mask=batch.get("loss_mask"))
    return output, partial(loss_func, batch.get("loss_mask"))


def train_valid_test_datasets_provider(num_samples: list[int], vp_stage: int | None = None) -> tuple:
    """Megatron's GPT datasets: mock data with ``--mock-data``, indexed datasets with ``--data-path``."""
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

    args = get_args()
    tokenizer = get_tokenizer()  # built by Megatron's set_global_variables from --tokenizer-type
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building GPT datasets (%s) ..." % dataset_type.__name__)

    def built_on_rank() -> bool:
        return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, built_on_rank, config).build()


def _config_builders() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Megatron's builders of the GPT config and of pretrain()'s config container (from the megatron-core release
    ``compat.PRETRAIN_ENTRY_FROM`` on).

    An older megatron-core's pretrain() takes a model_provider from Megatron-LM's pretrain_gpt.py, which its
    wheel does not ship; so this entry point stops here, before parsing or building anything, and says
    what works instead.
    """
    try:
        from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    except ImportError:
        from megatron.core import __version__ as version

        from ..integration import compat

        since = ".".join(map(str, compat.PRETRAIN_ENTRY_FROM))
        raise SystemExit(
            f"megatron-peakflat: python -m megatron_peakflat.pretrain needs megatron-core >= {since} (its pretrain() "
            f"builds the GPT from gpt_config_from_args), and this is megatron-core {version}. Fix: pip install "
            f"{compat.pip_spec(compat.PRETRAIN_ENTRY_FROM)}, or keep Megatron-LM's pretrain_gpt.py and add "
            f"megatron_peakflat.add_args and megatron_peakflat.apply(args) to it (README, 'Use it with Megatron'; the "
            f"patches run on {compat.CHECKED_ON[0]})"
        ) from None
    return gpt_config_from_args, pretrain_cfg_container_from_args


def _setup_logging(argv: list[str]) -> None:
    """Megatron's own logging set-up (``megatron.training.training`` runs the same at import): its handler on
    stdout, Python's default format (``INFO:megatron_peakflat:...``, as Megatron's lines read), and peakflat's rank
    filter from the first line on, so that what is logged before ``apply`` also comes from rank 0 only."""
    try:
        from megatron.training.log_handler import CustomHandler

        handler: logging.Handler = CustomHandler()
    except ImportError:
        handler = logging.StreamHandler(sys.stdout)
    logging.basicConfig(handlers=[handler], level=logging.INFO)
    from megatron_peakflat.integration.logs import install_rank_filter

    install_rank_filter("--peakflat-log-all-ranks" in argv)


def _check_gpus() -> None:
    """Megatron's pretraining asserts CUDA deep in its start-up, once per rank with a traceback: say it first,
    with what runs without a GPU. The CPU test shim (``testing.megatron_cpu``) stands in for CUDA on purpose."""
    import torch

    shim = sys.modules.get("megatron_peakflat.testing.megatron_cpu")
    if torch.cuda.is_available() or getattr(shim, "_INSTALLED", False):
        return
    raise SystemExit("megatron-peakflat: Megatron's pretraining needs CUDA GPUs, and this process sees none. Fix: "
                     "launch it on GPU nodes (torchrun, or sbatch examples/pretrain_moe.sh); without a GPU, "
                     "peakflat-check <the same flags> --gpus N checks the command line and the planner's fit, and "
                     "make demo trains a small model on CPU")


def main(argv: list[str] | None = None) -> None:
    """Parse Megatron's and peakflat's flags, apply the patches, and run Megatron's pretrain loop."""
    words = list(sys.argv[1:] if argv is None else argv)
    _setup_logging(words)
    if not {"-h", "--help"} & set(words):
        _check_gpus()
    try:
        flags = megatron_peakflat.auto_argv(_default_argv(words))
    except NothingFits as e:  # the planner's and peakflat-check's status for a run that does not fit
        print(f"megatron-peakflat: {e}", file=sys.stderr)
        raise SystemExit(NOTHING_FITS) from None
    except megatron_peakflat.PeakflatConfigError as e:
        raise SystemExit(f"megatron-peakflat: {e}") from None
    sys.argv = [sys.argv[0], *flags]
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.arguments import parse_and_validate_args

    gpt_config_from_args, pretrain_cfg_container_from_args = _config_builders()

    args = parse_and_validate_args(extra_args_provider=extra_args_provider,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    try:
        cfg = megatron_peakflat.apply(args)
    except megatron_peakflat.PeakflatConfigError as e:
        raise SystemExit(f"megatron-peakflat: {e}") from None
    from megatron_peakflat.integration import registry

    registry.apply_patches({"wheel-fixes"})
    log.info("peakflat: components on: %s", ", ".join(k for k, v in cfg.enabled.items() if v) or "none")
    train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
