"""Smoke benchmarks built from real bundled data (see docs/data.md)."""
