"""Runtime helpers the components share: the per-component peak meter (``meter.component_region``), this
rank's host-memory budget with what other components promised to pin (``host``), the machine probes
(``machine``: /proc/meminfo, LOCAL_WORLD_SIZE, cores) and the pinned host region that SCO's native pool and
OffloadStreamAdamW's state are carved from (``pinned``). None imports the planner; ``meter`` imports torch only
when it measures, ``host`` and ``machine`` never (the planner may import them), ``pinned`` at import. Nothing
is imported here: import ``runtime.meter``, ``runtime.host``, ``runtime.machine`` or ``runtime.pinned``
directly."""
