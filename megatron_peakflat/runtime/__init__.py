"""Runtime helpers the components share: the per-component peak meter (``meter.component_region``) and
this rank's host-memory budget with what other components promised to pin (``host``). Neither imports
torch at import time, and neither imports the planner. Nothing is imported here: import ``runtime.meter``
or ``runtime.host`` directly."""
