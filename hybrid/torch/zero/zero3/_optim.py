"""The optimizer of a :class:`~hybrid.torch.ZeRO3` model: any ``torch.optim`` optimizer stepping
this rank's flat slices of parameters with its slices of the averaged gradient.

The slices are cut into runs of one parameter group (:meth:`hybrid.core.FlatShardPlan.group_runs`),
one flat float32 tensor per run, as ZeRO2 does; for float32 parameters a run *is* a view of the
parameter slice, so the inner optimizer updates the slices in place. Nothing is gathered after
the step: the next forward gathers the updated slices.

With ``step_in_backward=True`` the inner optimizer steps each bucket's runs inside the backward,
the moment the bucket's gradient slice is reduced, and the slice is dropped at once: a rank holds
the gradient of one bucket at a time instead of its whole share (``4 P / N`` bytes of float32
gradient less at the peak), as torch's ``_apply_optimizer_in_backward`` does for FSDP. Memory
first throughout: each reduction (and its step) is finished before the next module's backward
gathers, instead of overlapping it.

With ``offload_dir=`` the inner optimizer's state tensors live in memory-mapped files there
(:mod:`._offload`), and ``step()`` steps bucket by bucket, so no more than one bucket's new state
is ever in memory before it moves to its files.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from hybrid.torch.zero._clip import clip_grad_norm_
from hybrid.torch.zero._parts import grads_on_masters, resolve_groups, run_closure
from hybrid.torch.zero._zero2_state import ShardedState
from hybrid.torch.zero.zero3._model import ZeRO3
from hybrid.torch.zero.zero3._offload import StateFiles

__all__ = ["ZeRO3Optimizer"]


class ZeRO3Optimizer(ShardedState, Optimizer):
    """``optimizer_class`` over a ZeRO3 model's slices: state ``1 / world_size`` of the unsharded.

    The counterpart of ``torch.optim.AdamW(model.parameters(), ...)`` for a sharded model: every
    rank updates its slice of every bucket with ``optimizer_class``, so the ranks together take
    the step DDP + that optimizer takes. ``param_groups``, ``state``, LR schedulers and
    ``state_dict()`` (torch's per-parameter format, a collective) work as on torch's optimizers.

    Args:
      module: the :class:`~hybrid.torch.ZeRO3` model.
      optimizer_class: a ``torch.optim.Optimizer`` subclass; it sees flat float32 tensors, so it
        must be elementwise (SGD, Adam, AdamW, ...), as with ZeRO2.
      param_groups: torch's group dicts over all of the model's sharded parameters, each in
        exactly one group; default one group of all.
      step_in_backward: update each bucket inside the backward as soon as its gradient slice is
        reduced, then drop the slice (opt-in; default False, torch's order: backward, then
        ``step()``). The parameters and state after each backward are bit for bit those of
        backward + ``step()``. Then every synchronised backward is a step: ``step()`` only runs
        its closure, ``zero_grad()`` has nothing to drop, gradient clipping is refused (it needs
        the whole gradient before any update), accumulate with ``model.no_sync()``, and a
        backward that raises part-way leaves the buckets stepped before it updated.
      offload_dir: a directory to keep the optimizer's state tensors in (opt-in; CPU parameters;
        default None, in memory): each is a memory-mapped file there, unlinked at once, stepped in
        place, as DeepSpeed's NVMe offload keeps it; ``step()`` then steps bucket by bucket. Results
        are bit for bit those without it; :meth:`offloaded_bytes` says how much the files hold.
      **defaults: forwarded to ``optimizer_class``.

    >>> import torch, torch.distributed as dist
    >>> from hybrid.torch import ZeRO3
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> model = ZeRO3(torch.nn.Linear(4, 2))
    >>> opt = ZeRO3Optimizer(model, torch.optim.AdamW, lr=0.1, param_groups=[
    ...     {"params": [model.module.weight], "weight_decay": 0.1},
    ...     {"params": [model.module.bias], "weight_decay": 0.0}])
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> opt.clip_grad_norm_(1.0)  # the norm of the whole gradient, as torch's clip_grad_norm_ returns
    tensor(9.4868)
    >>> opt.step(); opt.zero_grad()
    >>> opt.state_numel()  # exp_avg and exp_avg_sq of this rank's 10 elements
    20
    >>> dist.destroy_process_group()
    """

    def __init__(self, module: ZeRO3, optimizer_class: type[Optimizer],
                 param_groups: Iterable[dict[str, Any]] | None = None, *, step_in_backward: bool = False,
                 offload_dir: str | os.PathLike | None = None, **defaults: Any):
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            module = module._orig_mod  # torch.compile(model): the ZeRO3 model it runs
        if not isinstance(module, ZeRO3):
            raise TypeError(f"ZeRO3Optimizer needs a hybrid.torch.ZeRO3 model, got {type(module).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        self.module = module
        self.process_group = module.process_group
        self.world_size, self.rank = module.world_size, module.rank
        self._params = module._params
        self._group_of, self._torch_order, group_options = resolve_groups(
            param_groups, module._names, module._index_of, "ZeRO3Optimizer", "ZeRO3")
        self._plan, self._shards = module.bucket_plan, module.shards
        self._files = None if offload_dir is None else StateFiles(offload_dir, module._buckets.slices[0].device)
        self._segments = self._shards.group_runs(self.rank, self._group_of)
        slices = module._buckets.slices
        self._masters = []
        for seg in self._segments:
            mine = slices[seg.bucket][seg.lo:seg.hi]
            self._masters.append(mine if mine.dtype == torch.float32 else mine.float())
        self.optim: Optimizer = optimizer_class(
            [{**options, "params": [m for s, m in zip(self._segments, self._masters) if s.group == g]}
             for g, options in enumerate(group_options)], **defaults)
        Optimizer.__init__(self, list(self._masters), self.optim.defaults)
        # One set of groups and state: schedulers and users edit what the inner optimizer reads.
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self.step_in_backward = bool(step_in_backward)
        if self.step_in_backward:
            if module._grads.steps_in_backward:
                raise ValueError("ZeRO3Optimizer(step_in_backward=True): this ZeRO3 model already steps in its "
                                 "backward with another ZeRO3Optimizer; one optimizer per model (delete the other "
                                 "first)")
            module._grads.on_slice_reduced = _StepInBackward(self)

    @torch.no_grad()
    def _refresh_masters(self) -> None:
        """After the slices were set from outside (a checkpoint): the float32 copies of
        lower-precision slices follow (float32 masters are the slices themselves)."""
        slices = self.module._buckets.slices
        for seg, master in zip(self._segments, self._masters):
            mine = slices[seg.bucket][seg.lo:seg.hi]
            if master.data_ptr() != mine.data_ptr():
                master.copy_(mine)

    def grad_numel(self) -> int:
        """Elements of gradient this rank keeps between backward and step (its slices)."""
        return sum(g.numel() for g in self.module._grads.slices if g is not None)

    def state_numel(self) -> int:
        """Elements of optimizer state tensors this rank keeps (sliced, padding included)."""
        return sum(v.numel() for s in self.optim.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every rank's gradient slices (the norm of the
        whole averaged gradient, accumulated in float64: nearer the exact norm than torch's own,
        returned on every rank); a collective, between ``backward()`` and ``step()``.
        ``max_norm=float("inf")`` only measures."""
        self._refuse_in_backward("clip_grad_norm_")
        self.module._guard.enter("ZeRO3Optimizer.clip_grad_norm_()")
        slices = [g for g in self.module._grads.slices if g is not None]
        return clip_grad_norm_(slices, max_norm, norm_type, group=self.process_group, device=self._params[0].device,
                               error_if_nonfinite=error_if_nonfinite)

    def clip_grad_value_(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` on this rank's gradient slices (elementwise: exact)."""
        self._refuse_in_backward("clip_grad_value_")
        for g in self.module._grads.slices:
            if g is not None:
                g.clamp_(min=-clip_value, max=clip_value)

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's per-parameter format (see ZeRO2's): a collective, on every rank."""
        self.module._guard.enter("ZeRO3Optimizer.state_dict()")
        return super().state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradient slices; the parameters' ``.grad`` become None."""
        self.module._grads.zero_grad(set_to_none)

    def _refuse_in_backward(self, what: str) -> None:
        if self.step_in_backward:
            raise RuntimeError(f"ZeRO3Optimizer.{what}: this optimizer was made with step_in_backward=True, which "
                               f"updates each bucket inside the backward, before the whole gradient exists; "
                               f"clip with step_in_backward=False (backward, clip, then step())")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Update this rank's slices with the inner optimizer (no communication). With
        ``step_in_backward=True`` the backward has stepped already: only the closure runs."""
        loss = run_closure(closure)
        if self.step_in_backward:
            return loss
        if self._files is None:
            with grads_on_masters(self._segments, self._masters, self.module._grads.slices):
                self.optim.step(**kwargs)
        else:  # bucket by bucket: a first step's new state reaches its files a bucket at a time
            for b in range(len(self.module._grads.slices)):
                self._step_runs_of(b, **kwargs)
        self._round_slices(range(len(self._segments)))
        return loss

    def _step_runs_of(self, b: int, **kwargs: Any) -> list[int]:
        """Step bucket ``b``'s runs with its gradient slice (runs of other buckets have none, so the
        inner optimizer skips them: elementwise, the same update as one step over all); with
        ``offload_dir`` their new state moves to its files. Returns the runs' indices."""
        grads = [None] * len(self.module._grads.slices)
        grads[b] = self.module._grads.slices[b]
        with grads_on_masters(self._segments, self._masters, grads):
            self.optim.step(**kwargs)
        mine = [i for i, seg in enumerate(self._segments) if seg.bucket == b]
        self._settle(mine)
        return mine

    @torch.no_grad()
    def _step_bucket(self, b: int) -> None:
        """Inside the backward: step bucket ``b``'s runs with its just-reduced slice, then drop
        the slice."""
        self._round_slices(self._step_runs_of(b))
        self.module._grads.slices[b] = None

    def _settle(self, segments: Iterable[int]) -> None:
        """With ``offload_dir``: the segments' state tensors made in memory move to their files."""
        if self._files is not None:
            for i in segments:
                st = self.optim.state.get(self._masters[i])
                if st:
                    self._files.settle(st)

    def offloaded_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps in ``offload_dir``'s files (0 without it)."""
        return 0 if self._files is None else self._files.held_bytes()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's per-parameter format, each rank keeping its slices (see ZeRO2's); with
        ``offload_dir`` the loaded state moves to files."""
        super().load_state_dict(state_dict)
        self._settle(range(len(self._segments)))

    def _keep_state(self, value: torch.Tensor) -> torch.Tensor:
        """A state slice read from a checkpoint (a view of the read buffer), as the optimizer keeps
        it: in memory of its own, or in its file with ``offload_dir`` (never both at once)."""
        return value.clone() if self._files is None else self._files.keep(value)

    def _round_slices(self, segments: Iterable[int]) -> None:
        slices = self.module._buckets.slices
        for i in segments:
            seg, master = self._segments[i], self._masters[i]
            mine = slices[seg.bucket][seg.lo:seg.hi]
            if master.data_ptr() != mine.data_ptr():
                mine.copy_(master)  # lower-precision parameters: the float32 master, rounded


class _StepInBackward:
    """What the model calls as each bucket's slice is reduced: the optimizer's per-bucket step,
    held weakly, so a deleted optimizer stops stepping (and a new one may take its place) instead
    of being kept alive, and stepping, by the model."""

    def __init__(self, optimizer: ZeRO3Optimizer):
        self._step_bucket = weakref.WeakMethod(optimizer._step_bucket)

    @property
    def alive(self) -> bool:
        return self._step_bucket() is not None

    def __call__(self, bucket: int) -> None:
        step_bucket = self._step_bucket()
        if step_bucket is not None:
            step_bucket(bucket)
