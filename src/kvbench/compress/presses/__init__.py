"""Compression baselines, one file each (kvpress style): a dataclass of the method's hyper-parameters
with the defaults of its original repository."""
