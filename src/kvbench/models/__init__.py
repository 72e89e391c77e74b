"""Models: local checkpoints and the tiny zoo, loaded through one path.

Names are resolved lazily (PEP 562) so that light modules (``prompting``,
``tiny``) can be imported without importing transformers' model classes.
"""
from importlib import import_module

__all__ = ["CheckpointError", "check_checkpoint", "load_model", "save_checkpoint"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(import_module("kvbench.models.loader"), name)
    raise AttributeError(f"module 'kvbench.models' has no attribute {name!r}")
