"""One-off probes and studies behind design decisions; see bench/README.md."""
