"""The end of every distributed torch save (hybrid.checkpoint._protocol's steps 4-9 across ranks),
shared by the DDP / ZeRO-1 / ZeRO-2 path and ZeRO3's: each rank writes its file, rank 0 commits
the manifest, nobody returns before it is in place, and each rank frees its part of the replaced
checkpoint. A peer that dies or stalls in any of it becomes an error naming the save."""

from __future__ import annotations

import contextlib
import dataclasses

import torch.distributed as dist

from hybrid.checkpoint._files import write_shard
from hybrid.checkpoint._manifest import Manifest
from hybrid.checkpoint._protocol import abandon_save, commit_save, remove_previous_part


def named_collective(path, what: str, fn, *args, **kwargs):
    """Run a collective of a save; a peer that died or stalled becomes an error naming the save."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise RuntimeError(f"saving checkpoint {path}: rank {dist.get_rank()} failed in {what} (a peer died, "
                           f"stalled past the process group's timeout, or left); the previous checkpoint at "
                           f"this path is untouched. Cause: {e}") from e


@contextlib.contextmanager
def abandoned_on_failure(path, rank: int):
    """A distributed save from ``begin_save`` (rank 0) to its commit: if it fails on a rank, that
    rank removes what it staged (rank 0, which began the save, the whole staging directory), so
    a failed save leaves no ``.NAME.saving`` behind where any rank lives to clean it."""
    try:
        yield
    except BaseException:
        abandon_save(path, own_rank=None if rank == 0 else rank)
        raise


def write_and_commit(path, body: Manifest, tensors: dict, rank: int, world_size: int, group) -> Manifest | None:
    """Write this rank's file of ``body`` (every rank builds the same body; its digest goes in each
    file), then commit: rank 0 writes the manifest with every rank's file entry and returns it
    (the others ``None``)."""
    entry = write_shard(path, rank, world_size, tensors, body_digest=body.body_digest(), dtypes=body.tensor_dtypes())
    entries: list = [None] * world_size
    named_collective(path, "the all_gather_object of file checksums", dist.all_gather_object, entries, entry,
                     group=group)
    manifest = None
    if rank == 0:
        manifest = dataclasses.replace(body, files=tuple(entries))
        commit_save(path, manifest, remove_previous=False)
    # Nobody returns (and perhaps loads) before the manifest is in place.
    named_collective(path, "the barrier after the manifest", dist.barrier, group=group)
    # The replaced checkpoint: each rank frees its own old files, rank 0 the rest, the last one
    # out the directory; no barrier (the new checkpoint is in place, nobody waits on deletions).
    remove_previous_part(path, rank, world_size)
    return manifest
