"""The run's other state in torch's terms: what a checkpoint carries beside the model, the
optimizer, the step and the LR scheduler (a torchtitan run's ``dataloader`` and ``train_state``),
as the nested dict it was saved from, its tensors as torch tensors."""

from __future__ import annotations

import os

import torch


def carried_of(nested: dict, *, where: str) -> dict:
    """The manifest's ``run_state["carried"]`` for a nested dict of plain data and torch tensors
    (``save(..., other_state=)``); a value that is neither is a ValueError naming it."""
    from hybrid.checkpoint._other_state import Tensor, carried, flatten
    from hybrid.checkpoint.torch._dtypes import to_numpy
    from hybrid.core import canonical_dtype

    def stored(v):
        if isinstance(v, torch.Tensor):
            return Tensor(canonical_dtype(v.dtype), to_numpy(v).reshape(tuple(v.shape)).copy())
        if isinstance(v, (list, tuple)):
            return type(v)(stored(x) for x in v)
        if isinstance(v, dict):
            return {k: stored(x) for k, x in v.items()}
        return v

    return carried([(p, stored(v)) for p, v in flatten(nested)], source="hybrid", where=where)


def other_state(path: str | os.PathLike, *, format: str | None = None) -> dict:
    """The entries a checkpoint (hybrid's, or a torch DCP directory) carries for the run, nested
    as saved: ``{"dataloader": {...}, "train_state": {...}}`` for torchtitan's, ``{}`` for none.
    Give each to the object that saved it (``dataloader.load_state_dict(state["dataloader"])``).

    >>> import os, tempfile, torch, torch.distributed.checkpoint as dcp
    >>> model = torch.nn.Linear(2, 2)
    >>> d = os.path.join(tempfile.mkdtemp(), "dcp")
    >>> state = {"model": model.state_dict(), "step": 3, "train_state": {"log_steps": torch.tensor([1, 2])}}
    >>> _ = dcp.save(state, checkpoint_id=d, no_dist=True)
    >>> other_state(d)
    {'train_state': {'log_steps': tensor([1, 2])}}
    """
    from hybrid.checkpoint._formats import open_checkpoint
    from hybrid.checkpoint._other_state import Tensor, carried_entries, nest
    from hybrid.checkpoint.torch._dtypes import from_numpy

    def as_torch(v):
        if isinstance(v, Tensor):
            return from_numpy(v.array, getattr(torch, v.dtype), v.dtype).reshape(v.array.shape)
        if isinstance(v, (list, tuple)):
            return type(v)(as_torch(x) for x in v)
        if isinstance(v, dict):
            return {k: as_torch(x) for k, x in v.items()}
        return v

    ckpt = open_checkpoint(path, format=format)
    ckpt.verify([0])  # a hybrid manifest is the one its files were written for
    return nest([(p, as_torch(v)) for p, v in carried_entries(ckpt.manifest.run_state)])
