"""kvbench: reproducibility harness for CONDUIT and ResidualKV."""
__version__ = "0.1.0"
