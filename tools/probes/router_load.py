"""How unevenly a model's routers load their experts, iteration by iteration: each TopKRouter forward's token-expert
pairs per expert and the busiest expert's share over the balanced one (max / mean, what the planner's
``--routing-skew`` takes). Run it on a Megatron pretraining line; the line trains as it would.

    python -m torch.distributed.run --nproc-per-node 1 tools/probes/router_load.py <Megatron and --peakflat-* flags>
    PEAKFLAT_PROBE_CPU=1 python -m torch.distributed.run --nproc-per-node 1 tools/probes/router_load.py <flags>

With ``PEAKFLAT_PROBE_CPU=1`` it trains through the CPU dry run (``megatron_peakflat.testing.pretrain_dryrun``).
Under full recompute each layer's router runs twice per iteration (forward, then the recompute): both lines print.
``PEAKFLAT_PROBE_LINES`` (default 16) caps the lines printed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def record_router_loads(limit: int) -> None:
    """Wrap ``TopKRouter.forward`` so that its first ``limit`` calls print the load per expert."""
    from megatron.core.transformer.moe.router import TopKRouter

    forward = TopKRouter.forward
    seen = [0]

    def counted(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        out = forward(self, x, *args, **kwargs)
        if seen[0] < limit:
            counts = out[1].sum(0).float()  # routing_map [tokens, experts]
            print(f"ROUTER layer={self.layer_number} pairs={[int(c) for c in counts.tolist()]} "
                  f"max/mean={(counts.max() / counts.mean()).item():.3f}", flush=True)
        seen[0] += 1
        return out

    TopKRouter.forward = counted


def main(argv: list[str]) -> None:
    record_router_loads(int(os.environ.get("PEAKFLAT_PROBE_LINES", "16")))
    if os.environ.get("PEAKFLAT_PROBE_CPU") == "1":
        from megatron_peakflat.testing import pretrain_dryrun

        pretrain_dryrun.main(argv)
    else:
        from megatron_peakflat import pretrain

        pretrain.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
