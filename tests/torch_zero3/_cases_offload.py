"""Cases for ``ZeRO3Optimizer(offload_dir=)`` (issue 36, item 6 at 2 ranks), run in the worlds of
``test_zero3_dist`` (``_cases`` merges them): with the optimizer's state in memory-mapped files the
parameters and the state are those of torch's DDP + the plain optimizer (``_pair``'s tolerance:
bit for bit at 1 and 2 ranks), after ``step()`` and with ``step_in_backward``, also on a GPT whose
tied head is read in the parent's forward; every state tensor
lives in a file the directory no longer lists; and a checkpoint saved from and loaded into an
offloaded optimizer (hybrid's files and torch's state-dict format) puts the state in files."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from hybrid.checkpoint import torch as checkpoint
from hybrid.torch import ZeRO3Optimizer
from tests.torch_zero._cases import batch
from tests.torch_zero3._models import TinyGPT, tokens
from tests.torch_zero3._pair import LAYOUTS, Pair

NUM_STEPS = 3


def _state_in_files(opt: ZeRO3Optimizer, directory: str, what: str) -> None:
    """Every state tensor but the scalar step count is in a file (shared memory, outside the
    allocator); the files were unlinked as they were made."""
    tensors = [v for st in opt.optim.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    assert tensors, f"{what}: no state"
    in_memory = [tuple(v.shape) for v in tensors if not (v.is_shared() and opt._files.holds(v))]
    assert not in_memory, f"{what}: state tensors of shapes {in_memory} are in memory"
    assert opt.offloaded_bytes() == 4 * opt.state_numel(), (opt.offloaded_bytes(), opt.state_numel())
    assert os.listdir(directory) == [], f"{what}: files left in {directory}: {os.listdir(directory)}"


def offload(rank: int, world_size: int, *, optim: str, layout: str, groups: bool = False,
            step_in_backward: bool = False) -> None:
    with tempfile.TemporaryDirectory() as directory:
        pair = Pair(optim, LAYOUTS[layout], groups=groups,
                    optimizer_options={"offload_dir": directory, "step_in_backward": step_in_backward})
        for step in range(NUM_STEPS):
            pair.backward(batch(rank, step))
            pair.step()
            pair.check(world_size, f"step {step}")
            pair.check_state(f"step {step}")
            _state_in_files(pair.opt, directory, f"step {step}")
        del pair


def offload_tiny_gpt(rank: int, world_size: int) -> None:
    """A model whose head is read in the parent's forward (the tied embedding) and whose root owns
    a position table, stepped in the backward with its state in files: DDP's parameters."""
    with tempfile.TemporaryDirectory() as directory:
        pair = Pair("adam", LAYOUTS["four_buckets"], model=TinyGPT(),
                    optimizer_options={"offload_dir": directory, "step_in_backward": True})
        for step in range(NUM_STEPS):
            pair.backward(tokens(rank, step))
            pair.step()
            pair.check(world_size, f"step {step}")
            _state_in_files(pair.opt, directory, f"step {step}")
        del pair


def _shared_directory(rank: int) -> str:
    """One new directory every rank names (rank 0 makes it)."""
    name = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def offload_checkpoints(rank: int, world_size: int) -> None:
    """Train 2 steps, save (hybrid's files) and take torch's state dict; a fresh offloaded pair
    loads each and trains on, equal to the reference run that never stopped."""
    shared = _shared_directory(rank)
    try:
        with tempfile.TemporaryDirectory() as mine:
            pair = Pair("adamw", LAYOUTS["four_buckets"], optimizer_options={"offload_dir": mine})
            for step in range(2):
                pair.backward(batch(rank, step))
                pair.step()
            checkpoint.save(os.path.join(shared, "ckpt"), pair.zero, pair.opt, step=2)
            saved = pair.opt.state_dict()
            for load in ("checkpoint", "state_dict"):
                fresh = Pair("adamw", LAYOUTS["four_buckets"], optimizer_options={"offload_dir": mine})
                if load == "checkpoint":
                    checkpoint.load(os.path.join(shared, "ckpt"), fresh.zero, fresh.opt)
                else:
                    fresh.zero.load_state_dict(pair.zero.state_dict())
                    fresh.opt.load_state_dict(saved)
                _state_in_files(fresh.opt, mine, f"loaded from the {load}")
                # the reference goes on from where the saved run stopped (a copy: torch's optimizer
                # would share the state tensors of the dict it loads, and step them in place)
                fresh.ref_model.load_state_dict(pair.ref_model.state_dict())
                fresh.ref_opt.load_state_dict(copy.deepcopy(pair.ref_opt.state_dict()))
                for step in range(2, 4):
                    fresh.backward(batch(rank, step))
                    fresh.step()
                    fresh.check(world_size, f"loaded from the {load}, step {step}")
                _state_in_files(fresh.opt, mine, f"loaded from the {load}, after 2 steps")
                del fresh
            del pair
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(shared, ignore_errors=True)


CASES = {f"offload[{o}-{layout}{'-two_groups' if g else ''}{'-step_in_backward' if sib else ''}]": functools.partial(
    offload, optim=o, layout=layout, groups=g, step_in_backward=sib)
    for o, layout, g, sib in (("adam", "four_buckets", False, False), ("sgd_momentum", "memory_policy", False, False),
                              ("adamw", "six_buckets_prefetch_3", True, True), ("adam", "default", False, True))}
CASES["offload_checkpoints"] = offload_checkpoints
CASES["offload_tiny_gpt"] = offload_tiny_gpt
