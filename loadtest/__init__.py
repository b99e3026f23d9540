"""Load tests: kvgate side by side with direct access and a peer proxy (see docs/benchmarks.md)."""
