"""Evaluation: methods (KV-cache policies), metrics and the run loop (``kvbench eval``)."""
