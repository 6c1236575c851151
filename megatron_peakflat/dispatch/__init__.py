"""PipelinedLLEP: least-loaded expert parallelism with chunked, recomputed dispatch (no Megatron import).

- ``plan.py``: the least-loaded plan and the per-chunk routes (host arithmetic, identical on every rank);
- ``schedule.py``: one layer call's chunk count, split sizes and indices (one device-to-host sync);
- ``pipelined.py``: the autograd Function (dispatch -> experts -> combine per chunk, recomputed in backward);
- ``experts.py``: the ExpertBank protocol and the expert-weight exchange;
- ``comm.py``: the collectives (any backend, or a group of one); ``config.py``: ``DispatchConfig``;
- ``reference.py``: plain-PyTorch twins; ``api.py``: ``llep_moe``, ``plan_layer`` and ``working_set_bound``;
- ``bound.py``: the chunk count and the working-set bound as torch-free arithmetic (also the planner's).
"""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {name: ".api" for name in ("llep_moe", "plan_layer", "working_set_bound")})
