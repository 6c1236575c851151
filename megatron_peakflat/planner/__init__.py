"""Peak planner: the analytic per-rank memory model (``model``), its recommendation (``recommend``), the
Megatron command line it reads (``megatron_args``, ``shapes``), the planner's own flags read into a model, a
run and the knobs (``build``) and its reports (``report``). Its command line is ``cli/plan.py``, run as
``python -m megatron_peakflat.plan``. Nothing is imported here, so that the planner path stays free of torch:
import ``planner.model`` or ``planner.build`` directly. The algorithm packages never import this package
(``tests/test_layout.py``); the runtime helpers they use are in ``runtime``."""
