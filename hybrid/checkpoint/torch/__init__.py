"""Sharded checkpoints from and into torch: a DDP model with ZeroRedundancyOptimizer, ZeRO2 or a
plain ``torch.optim`` optimizer, its LR scheduler, buffers and run state, and torch's own
``state_dict()`` formats.

Every rank writes its own file (its flat slice of every bucket of the checkpoint plan) and rank 0
writes the manifest last; loading reads the slices it needs at any saved world size and restores
what torch's own ``load_state_dict`` calls restore.
"""

from hybrid.checkpoint.torch._load import load, state_dicts
from hybrid.checkpoint.torch._other_state import other_state
from hybrid.checkpoint.torch._save import save, save_state_dicts

__all__ = ["load", "other_state", "save", "save_state_dicts", "state_dicts"]
