"""Orchestrators for a lent GPU machine, above the plan layer: :mod:`.paper` runs the paper profile's jobs at real
shapes in DAG order (``scripts/gpu_paper.sh``), mirroring the commands the workflow's plans print."""
