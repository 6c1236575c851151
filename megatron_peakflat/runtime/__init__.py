"""Runtime helpers the components share: the per-component peak meter (``meter.component_region``), this
rank's host-memory budget with what other components promised to pin (``host``) and the machine probes
(``machine``: /proc/meminfo, LOCAL_WORLD_SIZE, cores). None imports the planner; ``meter`` imports torch only
when it measures, ``host`` and ``machine`` never (the planner may import them). Nothing is imported here:
import ``runtime.meter``, ``runtime.host`` or ``runtime.machine`` directly."""
