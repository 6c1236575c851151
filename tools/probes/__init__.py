"""One-off probes behind design decisions; see tools/probes/README.md."""
