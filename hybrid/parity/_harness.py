"""A parity run of a user's own torch/JAX model pair: the same weights, batches and optimizer
through both of hybrid's frontends, compared step by step; and hand-overs between them through a
checkpoint. See docs/parity.md.

A run is :func:`prepare` (the factories called, the pairing resolved, torch's initial weights
crossed to JAX, the batches drawn) -> :func:`train_torch` and :func:`train_jax` ->
:func:`hybrid.parity.compare`. :func:`run` and :func:`handover` do all of it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from hybrid.core import ParamMapping, ParamPairing
from hybrid.parity._bridge import jax_tree, named_torch, observed_ready_order, pair_models
from hybrid.parity._report import ParityReport, SideRun, Tolerance, compare
from hybrid.parity._spec import OptimizerSpec, check_split, count, global_batches, pair_of, portable, tree_map

STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class ParitySetup:
    """Everything both sides start from: the torch factory (as it travels to spawned ranks), the
    JAX params (torch's initial weights, through the pairing) and loss, the pairing, torch's
    initial weights by name, the global batches (numpy) and the optimizer."""

    torch_factory: object
    jax_params: object
    jax_loss: Callable
    pairing: ParamPairing
    init: dict
    batches: tuple
    optimizer: OptimizerSpec


def prepare(torch_pair, jax_pair, data, *, steps: int, optimizer: OptimizerSpec = OptimizerSpec(),
            mapping: ParamMapping | ParamPairing | None = None, seed: int = 0) -> ParitySetup:
    """Call both factories (torch's under ``torch.manual_seed(seed)``), pair the models through
    ``mapping`` (default ``ParamMapping.flax()``; ties found in the torch module) and cross torch's
    initial weights to the JAX tree; draw ``steps`` global batches from ``data``. The torch module
    takes one step (forward and backward, on step 0's batch; nothing is updated) to observe the
    order torch's backward makes the gradients ready (:func:`hybrid.torch.gradient_ready_order`):
    the pairing carries it, so the JAX side plans the buckets torch's DDP rebuilds, whatever the
    mapping's rules say about the order inside a module.

    Args:
      torch_pair: ``() -> (torch.nn.Module, loss_fn(module, batch) -> scalar tensor)``, or its
        ``"pkg.module:name"``. ``module`` in the loss is the DDP-wrapped model; ``batch`` the
        rank's rows, as torch tensors in the structure ``data`` gives.
      jax_pair: ``() -> (params, loss_fn(params, batch) -> scalar)``, or its reference; ``params``
        gives the tree's structure, names and shapes (its values are replaced by torch's).
      data: ``data(step) -> batch`` or an iterable of batches: numpy arrays (or dicts, lists,
        tuples of them) whose leading axis is the global batch. Each loss must be a mean over
        the rows it is given, so that DDP's average is the global batch's loss.

    >>> import jax.numpy as jnp, numpy as np
    >>> setup = prepare(lambda: (torch.nn.ModuleDict({"fc": torch.nn.Linear(3, 2)}), lambda m, x: m.module["fc"](x).mean()),
    ...                 lambda: ({"fc": {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(2)}},
    ...                          lambda p, x: (x @ p["fc"]["kernel"] + p["fc"]["bias"]).mean()),
    ...                 lambda step: np.full((4, 3), step, np.float32), steps=2)
    >>> [(p.torch, p.jax, str(p.layout)) for p in setup.pairing.pairs], len(setup.batches)
    ([('fc.weight', 'fc.kernel', 'transpose(1, 0)'), ('fc.bias', 'fc.bias', 'as is')], 2)
    >>> bool((np.asarray(setup.jax_params["fc"]["kernel"]) == setup.init["fc.weight"].T).all())  # torch's init
    True
    """
    steps = count("steps", steps)
    if not isinstance(optimizer, OptimizerSpec):
        raise TypeError(f"optimizer must be a hybrid.parity.OptimizerSpec, got {type(optimizer).__name__}")
    torch.manual_seed(count("seed", seed, least=0))
    module, torch_loss = pair_of(torch_pair, "torch")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"the torch factory must return (torch.nn.Module, loss_fn), got {type(module).__name__}")
    like, jax_loss = pair_of(jax_pair, "jax")
    if isinstance(mapping, ParamPairing):
        pairing = mapping
    else:
        pairing = pair_models(module, like, mapping)
    init = named_torch(module)
    batches = global_batches(data, steps)
    if not pairing.torch_ready:
        ready = observed_ready_order(module, torch_loss, tree_map(torch.from_numpy, batches[0]))
        pairing = pairing.with_torch_ready(ready)
    return ParitySetup(portable(torch_pair), jax_tree(like, pairing.to_jax(init)), jax_loss, pairing, init,
                       batches, optimizer)


def _check_stage(stage) -> int:
    if stage not in STAGES:
        raise ValueError(f"stage must be 0 (DDP alone), 1 (ZeRO-1), 2 (ZeRO-2) or 3 (ZeRO-3), got {stage!r}")
    return stage


def _check_save(setup: ParitySetup, save_at, save_to) -> None:
    if (save_at is None) != (save_to is None):
        raise ValueError("give save_at and save_to together")
    if save_at is not None and not 0 < count("save_at", save_at) <= len(setup.batches):
        raise ValueError(f"save_at must be in 1..{len(setup.batches)} (the steps), got {save_at!r}")


def train_torch(setup: ParitySetup, *, world_size: int = 2, stage: int = 1, resume=None, save_at: int | None = None,
                save_to=None, timeout_s: float = 300, progress=None, cancel: threading.Event | None = None) -> SideRun:
    """The torch side: ``hybrid.torch.DistributedDataParallel`` at torch's default caps (+
    ``ZeroRedundancyOptimizer`` for stage 1, ``ZeRO2`` for stage 2), or ``hybrid.torch.ZeRO3`` +
    ``ZeRO3Optimizer`` (stage 3, ZeRO3's default plan), on ``world_size`` gloo ranks (fresh
    processes: your script is not run again in them), rank ``r`` on rows ``[r B / W, (r + 1) B / W)``.
    ``resume`` / ``save_at`` + ``save_to``: checkpoints of :mod:`hybrid.checkpoint.torch`. A rank that
    raises is raised here with its traceback; one that dies (at import, killed) within about a
    second with its exit code and stderr; one that hangs at ``timeout_s``. ``cancel``: an event that
    stops the ranks when set."""
    from hybrid.parity._run_torch import train_torch_world

    world_size = count("world_size", world_size)
    job = torch_job(setup, world_size=world_size, stage=stage, resume=resume, save_at=save_at, save_to=save_to)
    return train_torch_world(job, world_size=world_size, timeout_s=timeout_s, progress=progress, cancel=cancel)


def torch_job(setup: ParitySetup, *, world_size: int = 2, stage: int = 1, resume=None, save_at: int | None = None,
              save_to=None) -> dict:
    """What each rank of :func:`train_torch`'s world runs (``hybrid.parity._run_torch.train_rank(job)``),
    the arguments checked as :func:`train_torch` checks them; for a caller that runs several jobs
    in one world of its own (the tests do: a world's start is most of a small run's time).

    >>> import jax.numpy as jnp, numpy as np
    >>> setup = prepare(lambda: (torch.nn.ModuleDict({"fc": torch.nn.Linear(3, 2)}), lambda m, x: m.module["fc"](x).mean()),
    ...                 lambda: ({"fc": {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(2)}}, lambda p, x: x.mean()),
    ...                 lambda step: np.ones((4, 3), np.float32), steps=2)
    >>> job = torch_job(setup, stage=2, save_at=1, save_to="ckpt")
    >>> job["stage"], job["save_at"], job["save_to"], len(job["batches"])
    (2, 1, 'ckpt', 2)
    >>> torch_job(setup, world_size=3)
    Traceback (most recent call last):
    ValueError: batch 0 has 4 rows, which the torch side's 3 ranks cannot split evenly
    """
    check_split(setup.batches, count("world_size", world_size), f"the torch side's {world_size} ranks")
    _check_save(setup, save_at, save_to)
    return dict(factory=setup.torch_factory, init=setup.init, optimizer=setup.optimizer, stage=_check_stage(stage),
                batches=setup.batches, resume=None if resume is None else str(resume), save_at=save_at,
                save_to=None if save_to is None else str(save_to))


def train_jax(setup: ParitySetup, *, num_devices: int = 2, stage: int = 1, resume=None, save_at: int | None = None,
              save_to=None, progress=None) -> SideRun:
    """The JAX side: ``hybrid.jax.zero`` at ``stage`` (stage 0: ``bucketed_all_reduce`` then the
    optimizer) under ``shard_map`` on this process's first ``num_devices`` devices, planned from
    the JAX backward's ready order through the pairing (torch's plan); stage 3 on
    ``hybrid.jax.shard_params``' slices through the pairing (torch ZeRO3's plan). ``resume`` / ``save_at`` +
    ``save_to``: checkpoints of :mod:`hybrid.checkpoint.jax` under torch's names and layouts."""
    from hybrid.parity._run_jax import train_jax as run

    num_devices = count("num_devices", num_devices)
    check_split(setup.batches, num_devices, f"the JAX side's {num_devices} devices")
    _check_save(setup, save_at, save_to)
    return run(setup, num_devices=num_devices, stage=_check_stage(stage), resume=resume, save_at=save_at,
               save_to=save_to, progress=progress)


def _check_tolerance(tolerance: Tolerance, setup: ParitySetup) -> None:
    """Before anything trains: a per-tensor pattern that matches none of the pair's tensors is a typo."""
    if not isinstance(tolerance, Tolerance):
        raise TypeError(f"tolerance must be a hybrid.parity.Tolerance, got {type(tolerance).__name__}")
    tolerance.check_names(setup.pairing.torch_names)


def run(torch_pair, jax_pair, data, *, steps: int = 10, optimizer: OptimizerSpec = OptimizerSpec(),
        world_size: int = 2, num_devices: int = 2, stage: int = 1, mapping=None, seed: int = 0,
        tolerance: Tolerance = Tolerance(), timeout_s: float = 300) -> ParityReport:
    """Train the pair with both frontends from the same weights on the same global batches and
    compare them (torch is the reference): per-step losses, final parameters per tensor, plans.

    The torch ranks run while JAX trains in this process; whichever side fails first ends the
    other within a step. Where JAX has not started yet (``import jax`` alone does not start it),
    its CPU platform is given ``num_devices`` devices, so a script needs no ``XLA_FLAGS``; and the
    torch ranks do not run the calling script again, so it needs no ``__main__`` guard. Arguments
    as :func:`prepare`, :func:`train_torch` and :func:`train_jax`; ``tolerance`` decides the
    report's verdicts. See docs/parity.md for a whole example.
    """
    from hybrid.demo import ensure_host_devices

    ensure_host_devices(count("num_devices", num_devices))  # before the JAX factory starts JAX
    setup = prepare(torch_pair, jax_pair, data, steps=steps, optimizer=optimizer, mapping=mapping, seed=seed)
    _check_tolerance(tolerance, setup)
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        torch_side = pool.submit(train_torch, setup, world_size=world_size, stage=stage, timeout_s=timeout_s,
                                 cancel=stop)
        try:
            jax_side = train_jax(setup, num_devices=num_devices, stage=stage, progress=_raise_if_failed(torch_side))
        except BaseException:
            stop.set()  # the torch ranks end now, not at their timeout
            raise
        return compare(torch_side.result(), jax_side, tolerance=tolerance)


def _raise_if_failed(side: concurrent.futures.Future):
    """A progress callback that raises the other side's error as soon as it has one."""
    def progress(step, loss):
        del step, loss
        if side.done() and side.exception() is not None:
            raise side.exception()
    return progress


def handover(torch_pair, jax_pair, data, *, at: int, to: str = "jax", steps: int = 10,
             optimizer: OptimizerSpec = OptimizerSpec(), world_size: int = 2, num_devices: int = 3,
             stage: int = 1, mapping=None, seed: int = 0, tolerance: Tolerance = Tolerance(), path=None,
             timeout_s: float = 300) -> ParityReport:
    """One framework trains ``steps`` steps, saving a checkpoint after step ``at``; the other
    (``to``: ``"jax"`` or ``"torch"``) resumes from it through the mapping and trains on. The report
    compares the resumed steps and final parameters against the uninterrupted run (the reference).

    The optimizer state crosses too (Adam's moments, momentum), so the optimizer must keep some:
    adam, adamw, or sgd with momentum. ``path``: where the checkpoint goes (default a temporary
    folder, removed afterwards).
    """
    if to not in ("jax", "torch"):
        raise ValueError(f"to must be 'jax' or 'torch', got {to!r}")
    if not 0 < count("at", at) < count("steps", steps):
        raise ValueError(f"at must be in 1..{steps - 1}, a step before the last, got {at!r}")
    if not optimizer.stateful:
        raise ValueError("sgd without momentum keeps no optimizer state to hand over: give momentum, or use adam")
    from hybrid.demo import ensure_host_devices

    ensure_host_devices(count("num_devices", num_devices))
    setup = prepare(torch_pair, jax_pair, data, steps=steps, optimizer=optimizer, mapping=mapping, seed=seed)
    _check_tolerance(tolerance, setup)
    with tempfile.TemporaryDirectory(prefix="hybrid-parity-") as tmp:
        where = Path(path) if path is not None else Path(tmp) / "checkpoint"
        torch_kw = dict(world_size=world_size, stage=stage, timeout_s=timeout_s)
        jax_kw = dict(num_devices=num_devices, stage=stage)
        if to == "jax":
            reference = train_torch(setup, save_at=at, save_to=where, **torch_kw)
            resumed = train_jax(setup, resume=where, **jax_kw)
        else:
            reference = train_jax(setup, save_at=at, save_to=where, **jax_kw)
            resumed = train_torch(setup, resume=where, **torch_kw)
    resumed = dataclasses.replace(resumed, label=f"{resumed.label}, resumed at step {at}")
    return compare(reference, resumed, tolerance=tolerance)
