"""ZeRO-2: gradients and optimizer state sharded flat over the ranks, driven by a DDP comm hook.

The layout is :func:`hybrid.core.shard_flat` over the DDP's own :class:`~hybrid.core.BucketPlan`:
bucket ``b`` is padded to ``world_size * shard_sizes[b]`` elements and rank ``r`` owns the ``r``-th
equal slice. The comm hook reduce-scatters each bucket as soon as DDP launches it (on gloo it
all-reduces and slices, which is faster there), so a rank keeps
only its gradient slice; ``step()`` runs the inner ``torch.optim`` optimizer on one flat float32
master slice per bucket (so its state is ``1 / world_size`` of the unsharded state, plus at most
``world_size - 1`` padding elements per bucket), then all-gathers the updated parameters.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from hybrid.core import BucketPlan, FlatShardPlan, shard_flat
from hybrid.torch.ddp._ddp import DistributedDataParallel, GradBucket
from hybrid.torch._flat import params_into_flat
from hybrid.torch.zero._clip import clip_grad_norm_
from hybrid.torch.zero._zero2_grads import GradientInShards
from hybrid.torch.zero._zero2_state import ShardedState, _take
from hybrid.torch._collectives import all_gather_into, reduce_scatter_into, wait_all
from hybrid.torch._teardown import collect_cycles_at_exit
from hybrid.torch.zero._parts import _refuse_sparse, cleared_slices, grads_on_masters, resolve_groups, run_closure

__all__ = ["ZeRO2"]

# torch 2.13 renamed the flat collectives (the old names warn); older torch has only the old ones.


class _ZeRO2JoinHook(JoinHook):
    """A joined rank's shadow of ``step()``: DDP's join hook has already run the ZeRO2 comm hook
    on zero buckets, so this rank holds the others' reduced gradients for its slices; it updates
    them and takes part in the parameter gather, then drops the slices (nobody calls zero_grad)."""

    def __init__(self, zero: "ZeRO2"):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()
        self.zero.zero_grad(set_to_none=True)


class ZeRO2(ShardedState, Optimizer, Joinable):
    """Any ``torch.optim`` optimizer with gradients and state sharded flat over the DDP's ranks.

    Registers a comm hook on ``module`` (a :class:`hybrid.torch.DistributedDataParallel`) that
    reduce-scatters every gradient bucket instead of all-reducing it (on gloo: all-reduces it and
    keeps the slice, which is faster there). After ``backward()`` each rank holds only its slice
    of the averaged gradient; the parameters' ``.grad`` hold a :class:`GradientInShards` stand-in
    that raises a ``TypeError`` naming the parameter when used (so
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` fails loudly instead of clipping
    nothing). Clip with :meth:`clip_grad_norm_` / :meth:`clip_grad_value_`, exact over the slices.
    ``step()`` updates this rank's slice of every bucket with ``optimizer_class`` and all-gathers
    the parameters, so every rank ends the step with the same full model, as DDP + the plain
    optimizer would. Works from the first iteration; when DDP rebuilds its buckets (after the
    first iteration) the optimizer state is re-sliced to the new layout at the next ``step()``.
    The parameters' ``.data`` become views into one padded flat buffer per bucket. Uneven inputs:
    ``Join([ddp, zero2])``, as with torch's ZeroRedundancyOptimizer (a joined rank still updates
    its slices and sends them).

    Args:
      module: the DDP-wrapped model; its process group is the one sharded over.
      optimizer_class: a ``torch.optim.Optimizer`` subclass; it sees flat float32 tensors, one per
        run of one parameter group in each bucket slice (elementwise optimizers such as SGD, Adam,
        AdamW give DDP's results; optimizers that look across a tensor, e.g. LAMB's trust ratio,
        would see the slice instead).
      param_groups: torch's parameter groups (dicts with ``"params"`` and per-group options) over
        all of ``module``'s parameters, each in exactly one group; default one group of all.
        ``param_groups``, schedulers and ``state_dict()`` index them as torch's optimizers do.
      **defaults: forwarded to ``optimizer_class``.

    >>> import torch, torch.distributed as dist
    >>> from hybrid.torch import DistributedDataParallel
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> opt = ZeRO2(ddp, torch.optim.AdamW, lr=0.1, param_groups=[
    ...     {"params": [ddp.module.weight], "weight_decay": 0.1},
    ...     {"params": [ddp.module.bias], "weight_decay": 0.0}])
    >>> ddp(torch.ones(3, 4)).sum().backward()
    >>> ddp.module.weight.grad, opt.grad_numel()
    (GradientInShards('weight', shape=(2, 4)), 10)
    >>> opt.clip_grad_norm_(1.0)  # the norm of the whole gradient, as torch's clip_grad_norm_ returns
    tensor(9.4868)
    >>> opt.step()
    >>> opt.zero_grad()
    >>> [g["weight_decay"] for g in opt.state_dict()["param_groups"]]
    [0.1, 0.0]
    >>> dist.destroy_process_group()
    """

    def __init__(self, module: DistributedDataParallel, optimizer_class: type[Optimizer],
                 param_groups: Iterable[dict[str, Any]] | None = None, **defaults: Any):
        if not isinstance(module, DistributedDataParallel):
            raise TypeError("ZeRO2 needs a hybrid.torch.DistributedDataParallel module, got "
                            f"{type(module).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if module.find_unused_parameters and not module.static_graph:
            # torch's optimizers skip a parameter whose .grad is None; a flat slice cannot skip
            # part of itself, so an unused parameter would see a zero gradient instead.
            raise NotImplementedError("ZeRO2 does not support find_unused_parameters=True")
        _refuse_sparse(module, "ZeRO2")
        Joinable.__init__(self)
        self._ddp = module
        self.process_group = module.process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._params: list[torch.Tensor] = list(module._params)
        # _group_of[i]: the group of DDP parameter i; _torch_order: DDP indices in torch's state
        # dict numbering (group by group, in each group's own order).
        self._group_of, self._torch_order, group_options = resolve_groups(
            param_groups, module._names, module._index_of, "ZeRO2", "DDP")
        self._grad_plan: BucketPlan | None = None  # the layout of the gradient slices
        self._grad_shards: FlatShardPlan | None = None
        self._grads: list[torch.Tensor | None] = []
        self._padded: list[torch.Tensor | None] = []
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None
        # gloo's reduce-scatter and all-gather are 2-5x slower than its all-reduce and broadcast
        # (measured on 2 ranks, 36 MiB: 136 ms / 107 ms vs 57 ms / 23 ms), so on gloo gradients are
        # all-reduced and sliced, parameters broadcast slice by slice; elsewhere (NCCL) the flat
        # collectives. The memory kept is the same: only the slices outlive the hook.
        self._flat_collectives = dist.get_backend(self.process_group) != dist.Backend.GLOO
        # What bucket_cap_mb="auto" plans the DDP's buckets for: this hook's collective per bucket and
        # the parameter gathers after the step (on gloo: every rank broadcasts its slice).
        module._reducer.rebuild.collectives = (("reduce_scatter", (("all_gather", 1),)) if self._flat_collectives
                                    else ("all_reduce", (("broadcast", self.world_size),)))
        self._set_param_plan(module.bucket_plan)
        self.optim: Optimizer = optimizer_class(
            [{**options, "params": self._masters_of(g)} for g, options in enumerate(group_options)], **defaults)
        Optimizer.__init__(self, list(self._masters), self.optim.defaults)
        # One set of groups and state: schedulers and users edit what the inner optimizer reads.
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        module.register_comm_hook(None, self._hook)
        module._reducer.comm_hook_owns_grads = True  # the DDP leaves .grad to the hook
        collect_cycles_at_exit()  # the DDP and this optimizer now refer to each other
        # The stand-ins must be gone before autograd accumulates into .grad again.
        module.register_forward_pre_hook(lambda *_: self._drop_stand_ins())

    # -- layout ----------------------------------------------------------------------------------

    def _set_param_plan(self, plan: BucketPlan) -> None:
        """Move the parameters into one padded flat buffer per bucket and cut the master segments.

        ``param.data`` becomes a view into its bucket's buffer (as with ZeroRedundancyOptimizer's
        ``parameters_as_bucket_view``), so the gather writes the parameters in place. For float32
        parameters the master segments *are* views of this rank's slice of that buffer: the inner
        optimizer updates the parameters directly and nothing is copied.
        """
        self._plan = plan
        self._shards = shard_flat(plan, self.world_size)
        self._segments = self._shards.group_runs(self.rank, self._group_of)
        self._flat_params = [params_into_flat(self._params, bucket, self._shards.padded_length(b))
                              for b, bucket in enumerate(plan.buckets)]
        self._masters = []
        for seg in self._segments:
            mine = self._my_slice(seg.bucket)[seg.lo:seg.hi]
            self._masters.append(mine if mine.dtype == torch.float32 else mine.float())

    def _my_slice(self, b: int) -> torch.Tensor:
        start, stop = self._shards.shard_range(b, self.rank)
        return self._flat_params[b][start:stop]

    def _masters_of(self, group: int) -> list[torch.Tensor]:
        return [m for seg, m in zip(self._segments, self._masters) if seg.group == group]

    def _set_grad_plan(self, plan: BucketPlan) -> None:
        """Lay the gradient slices out for ``plan``; slices being accumulated are re-cut.

        Runs in the first hook of a backward pass, on every rank at the same point, so the
        all-gathers of accumulated slices pair up across ranks.
        """
        shards = shard_flat(plan, self.world_size)
        grads: list[torch.Tensor | None] = [None] * len(plan.buckets)
        if self._grad_plan is not None and all(g is not None for g in self._grads):
            full = self._gather_per_tensor(self._grad_plan, self._grad_shards, self._grads)
            grads = [_take(shards, b, self.rank, full, dtype=torch.float32) for b in range(len(plan.buckets))]
        self._grad_plan, self._grad_shards, self._grads = plan, shards, grads
        self._padded = [None] * len(plan.buckets)

    # -- the comm hook ---------------------------------------------------------------------------

    def _hook(self, state: object, bucket: GradBucket) -> torch.futures.Future:
        del state
        plan = self._ddp.bucket_plan
        if plan is not self._grad_plan:
            self._set_grad_plan(plan)
        b, buf = bucket.index(), bucket.buffer()
        if not self._flat_collectives:
            return self._all_reduce_and_slice(b, bucket)
        padded = self._grad_shards.padded_length(b)
        if padded == buf.numel():
            src = buf
        else:
            # The core's slices are ceil(length / world_size) long: the collective needs the
            # padding to exist, so the bucket is copied once into a padded buffer.
            if self._padded[b] is None:
                self._padded[b] = torch.zeros(padded, dtype=buf.dtype, device=buf.device)
            src = self._padded[b]
            src[:buf.numel()].copy_(buf)
        src.div_(self.world_size)  # torch's allreduce_hook: divide, then sum
        out = torch.empty(self._grad_shards.shard_sizes[b], dtype=buf.dtype, device=buf.device)
        fut = self._future_of(reduce_scatter_into(out, src, group=self.process_group, async_op=True))
        # The bucket holds the local gradient now; the full tensor need not live on.
        self._stand_in_grads(bucket)

        def keep_slice(done):
            wait_all([(f"ZeRO2 (DDP comm hook): the reduce-scatter of gradient bucket {b}", done)])
            g = out.float()
            if self._grads[b] is None:
                self._grads[b] = g
            else:
                self._grads[b].add_(g)  # accumulation across backward passes, as .grad does
            return buf  # DDP's own buffer: DDP copies nothing back
        return fut.then(keep_slice)

    def _all_reduce_and_slice(self, b: int, bucket: GradBucket) -> torch.futures.Future:
        """gloo: all-reduce the bucket, keep this rank's slice (gloo's reduce-scatter is slower)."""
        buf = bucket.buffer()
        buf.div_(self.world_size)
        fut = dist.all_reduce(buf, group=self.process_group, async_op=True).get_future()
        self._stand_in_grads(bucket)
        start, stop = self._grad_shards.shard_range(b, self.rank)

        def keep_slice(done):
            wait_all([(f"ZeRO2 (DDP comm hook): the all-reduce of gradient bucket {b}", done)])
            g = torch.zeros(stop - start, dtype=torch.float32, device=buf.device)
            valid = buf[start:min(stop, buf.numel())]
            g[:valid.numel()] = valid
            if self._grads[b] is None:
                self._grads[b] = g
            else:
                self._grads[b].add_(g)
            return buf
        return fut.then(keep_slice)

    def _stand_in_grads(self, bucket: GradBucket) -> None:
        for p in bucket.parameters():
            p.grad = GradientInShards.of(p, self._ddp._names[self._ddp._index_of[id(p)]])

    def _drop_stand_ins(self) -> None:
        for p in self._params:
            if isinstance(p.grad, GradientInShards):
                p.grad = None

    def _future_of(self, work) -> torch.futures.Future:
        """The work's future; gloo's reduce-scatter has none, so a helper thread waits for it.

        The collective itself still runs asynchronously on gloo's own threads; the helper only
        turns its completion into a Future, so the backward pass goes on meanwhile.
        """
        try:
            return work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented" (ProcessGroupGloo, torch 2.13)
            pass
        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybrid-zero2")
        fut = torch.futures.Future()

        def wait():
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the Future
                fut.set_exception(e)
            else:
                fut.set_result(None)
        self._waiter.submit(wait)
        return fut

    # -- optimizer protocol ----------------------------------------------------------------------

    def grad_numel(self) -> int:
        """Elements of gradient this rank keeps between backward and step (its slices)."""
        return sum(g.numel() for g in self._grads if g is not None)

    def state_numel(self) -> int:
        """Elements of optimizer state tensors this rank keeps (sliced, padding included)."""
        return sum(v.numel() for s in self.optim.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradient slices of every rank; a collective.

        The norm is that of the whole averaged gradient (one all-reduce of the ranks' partial
        norms, accumulated in float64: nearer the exact norm than torch's own float32 sum),
        returned on every rank as FSDP's ``clip_grad_norm_`` does; every slice is scaled by
        ``min(max_norm / (norm + 1e-6), 1)``, as torch scales ``.grad``. Call it between
        ``backward()`` and ``step()`` on every rank; ``max_norm=float("inf")`` only measures.
        """
        slices = [g for g in self._grads if g is not None]
        return clip_grad_norm_(slices, max_norm, norm_type, group=self.process_group, device=self.join_device,
                               error_if_nonfinite=error_if_nonfinite)

    def clip_grad_value_(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` on this rank's gradient slices (elementwise: exact)."""
        for g in self._grads:
            if g is not None:
                g.clamp_(min=-clip_value, max=clip_value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradient slices; the parameters' own ``.grad`` stay ``None``."""
        self._grads = cleared_slices(self._grads, set_to_none)
        for p in self._params:
            p.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Update this rank's slices with the inner optimizer, then all-gather the parameters."""
        Join.notify_join_context(self)
        loss = run_closure(closure)
        if self._grad_plan is not None and self._grad_plan != self._plan:
            self._relayout(self._grad_plan)
        try:
            with grads_on_masters(self._segments, self._masters, self._grads):
                self.optim.step(**kwargs)
        finally:
            # Also when the local step raised (on this rank only, say): every rank still sends
            # its slices (this rank's unchanged, if the optimizer raised before changing them),
            # so the other ranks' gathers pair up and the next step works.
            self._all_gather_params()
        return loss

    # -- Join -----------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that lets a rank that ran out of inputs keep stepping with the others."""
        del kwargs  # no options
        return _ZeRO2JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _all_gather_params(self) -> None:
        """Every rank's updated slices into every rank's flat parameter buffers (in place)."""
        for seg, master in zip(self._segments, self._masters):
            mine = self._my_slice(seg.bucket)[seg.lo:seg.hi]
            if master.data_ptr() != mine.data_ptr():
                mine.copy_(master)  # lower-precision parameters: the float32 master, rounded
        works = []
        for b, full in enumerate(self._flat_params):
            size = self._shards.shard_sizes[b]
            if self._flat_collectives:
                works.append((f"ZeRO2.step: the all-gather of bucket {b}'s parameters",
                              all_gather_into(full, self._my_slice(b).clone(), group=self.process_group, async_op=True)))
            else:
                # gloo: one broadcast per rank straight into its slice beats gloo's all-gather.
                works += [(f"ZeRO2.step: the broadcast of rank {r}'s slice of bucket {b}",
                           dist.broadcast(full[r * size:(r + 1) * size], src=dist.get_global_rank(self.process_group, r),
                                          group=self.process_group, async_op=True)) for r in range(self.world_size)]
        wait_all(works)
