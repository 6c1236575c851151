"""What Transformer Engine's fused attention backward allocates with and without determinism (the planner's
``te_limits.deterministic_workspace_bytes``: a [b, heads, s_q, s_kv] bf16 dP workspace under --deterministic-mode).

    python3 tools/probes/te_deterministic_workspace.py [SEQ ...]

Each length runs in its own process per setting, since TE reads NVTE_ALLOW_NONDETERMINISTIC_ALGO when it picks the
backend. Prints the backward's peak beyond its inputs and the planner's workspace for the same call.
"""

from __future__ import annotations

import os
import subprocess
import sys

HEADS, GROUPS, DIM = 32, 2, 64


def one(seq: int) -> None:
    import torch
    import transformer_engine.pytorch as te

    attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, attn_mask_type="causal", qkv_format="sbhd",
                                  attention_dropout=0.0).cuda()
    q = torch.randn(seq, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(seq, 1, GROUPS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(seq, 1, GROUPS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = attn(q, k, v)
    grad = torch.ones_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        out.backward(grad)
        torch.cuda.synchronize()
        peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.3f} GiB"
    except torch.OutOfMemoryError as e:
        peak = "OOM: " + str(e).splitlines()[0][:160]
    from megatron_peakflat.planner.te_limits import deterministic_workspace_bytes

    det = os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0"
    dp = deterministic_workspace_bytes(micro_batch=1, heads=HEADS, tp=1, q_tokens=seq, kv_tokens=seq) / 2**30
    accum = HEADS * seq * DIM * 4 / 2**30
    print(f"seq={seq} deterministic={det}: backward peak beyond inputs {peak}; planner: dP workspace {dp:.3f} GiB "
          f"(deterministic), fp32 dQ accumulator {accum:.3f} GiB (not)", flush=True)


def main() -> None:
    if os.environ.get("_PROBE_SEQ"):
        one(int(os.environ["_PROBE_SEQ"]))
        return
    for seq in [int(a) for a in sys.argv[1:]] or [4096, 16384]:
        for flag in ("1", "0"):
            env = {**os.environ, "_PROBE_SEQ": str(seq), "NVTE_ALLOW_NONDETERMINISTIC_ALGO": flag}
            subprocess.run([sys.executable, __file__], env=env, check=False)


if __name__ == "__main__":
    main()
