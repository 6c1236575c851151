"""Peak planner: the analytic per-rank memory model (``model``), its recommendation (``recommend``), the
Megatron command line it reads (``megatron_args``, ``shapes``) and its command line (``cli``; entry
``plan``, run as ``python -m megatron_peakflat.plan``). Nothing is imported here, so that the planner path
stays free of torch: import ``planner.model`` or ``planner.cli`` directly. The algorithm packages never
import this package (``tests/test_layout.py``); the runtime helpers they use are in ``runtime``."""
