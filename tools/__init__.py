"""Repository tools: GPU run scripts and one-off probes (not part of the package)."""
