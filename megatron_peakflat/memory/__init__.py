"""Peak planner (analytic per-rank memory model, ``python -m megatron_peakflat.plan``) and the runtime
per-component peak meter (``meter.component_region``). Nothing is imported here, so that the planner
path stays free of torch: import ``memory.model``, ``memory.cli`` or ``memory.meter`` directly."""
