"""``python -m megatron_peakflat.pretrain``: Megatron's GPT/MoE pretraining with the peakflat patches. Its code lives
in ``cli/pretrain.py``; this module keeps the short spelling."""

from .cli.pretrain import main

if __name__ == "__main__":
    main()
