"""Models: local checkpoints and the tiny zoo, loaded through one path."""
from kvbench.models.loader import CheckpointError, check_checkpoint, load_model, save_checkpoint

__all__ = ["CheckpointError", "check_checkpoint", "load_model", "save_checkpoint"]
