"""The reducer half of hybrid's DDP: gradient-ready hooks, filling and launching buckets, finalize.

The per-iteration bookkeeping is the explicit ``ReducerState`` of ``hybrid.core._reducer_state``;
these methods move tensors and issue the collectives (torch's C++ ``Reducer``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybrid.core import plan_buckets, rebuild_plan
from hybrid.core import BucketPlan
from hybrid.core._reducer_state import ReducerState, mark_ready, mark_unused, start_iteration
from hybrid.torch._collectives import naming
from hybrid.torch.ddp._auto import ReadyClock, plan_auto
from hybrid.torch.ddp._parts import marked_twice_message, specs
from hybrid.torch.ddp.reducer._buckets import BucketBuffers
from hybrid.torch.ddp.reducer._sparse import SparseBuckets, refuse_sparse_in_dense


def _hook_tensor(value, b: int) -> torch.Tensor:
    """The reduced bucket a comm hook's Future holds: a tensor (or a one-tensor list, what
    ``work.get_future()`` holds); anything else raises as torch does, naming the bucket."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"Unable to cast {value!r} to Tensor: the Future returned by the "
                           f"communication hook for bucket {b} must hold the reduced bucket as a tensor")
    return value


class Reducer:
    """Mixed into :class:`hybrid.torch.DistributedDataParallel`, which owns the attributes used."""

    def _init_reducer(self) -> None:
        """A fresh reducer over ``self._params``: initial plan, empty state, one hook per parameter
        (torch's ``_ddp_init_helper``; also what unpickling runs, as torch's ``__setstate__``)."""
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._iteration = 0
        self._delaying = False
        self._comm_hook: tuple[object, Callable] | None = None
        self._has_rebuilt = False
        self._last_order = None
        self._expect_hooks = False
        self._state: ReducerState | None = None
        self._static_unused: tuple[int, ...] | None = None  # static_graph: found in iteration 1
        self._static_globally_unused: set[int] | None = None
        self._futures: list = []
        # Futures a buffer comm hook returned, waited for once the backward's reduction finishes
        # (torch's Reducer::install_futures).
        self._installed_futures: list = []
        self._used_work = None
        self._used_in_window: set[int] = set()  # used under no_sync() since the last reduction
        self._undefined_now: set[int] = set()  # hooks that fired with .grad None (find_unused)
        self._pending_unused: tuple[int, ...] = ()  # unused in this iteration, marked ready by us
        self._num_buckets_reduced = 0  # in the last synchronizing backward (torch's, for its logger)
        self._graph_static, self._prev_unused = True, None  # whether the unused set ever changed
        # bucket_cap_mb="auto": the hooks time the gradients until the rebuild (hybrid/torch/ddp/_auto.py)
        self._ready_clock = ReadyClock(len(self._params), self.device) if self._auto_caps else None
        self._last_ready_s = None
        bucket_specs = specs(self.module, self.parameters_to_ignore)
        if self._mixed is not None:
            bucket_specs = self._mixed.bucket_specs(bucket_specs)
        self._sparse = SparseBuckets(self._params, self._names)
        self._buckets = BucketBuffers(self._params, self.device,
                                      bucket_dtype=None if self._mixed is None else self._mixed.bucket_dtype,
                                      grads_in_buckets=self._grads_in_buckets, batched_copy=self.batched_grad_copy)
        self._set_plan(plan_buckets(bucket_specs, size_limits=self._initial_limits))
        self._log_construction()
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    def _set_plan(self, plan: BucketPlan) -> None:
        self._buckets.set_plan(plan)
        # The start state is an immutable value: every iteration on this plan starts from it.
        self._start_state = start_iteration(plan)

    @property
    def bucket_plan(self) -> BucketPlan:
        """The :class:`~hybrid.core.BucketPlan` in use."""
        return self._buckets.plan

    def _make_hook(self, index: int):
        # The parameter holds its hook: a hook holding the DDP would make parameter -> hook -> DDP
        # -> module -> parameter a reference cycle, which keeps the DDP and its process group alive
        # past destroy_process_group until some garbage collection, at worst the one at interpreter
        # exit, when gloo's worker threads can no longer take the GIL (the process aborts). torch's
        # DDP goes with its last reference; so does ours.
        ddp_ref = weakref.ref(self)

        def hook(param):
            ddp = ddp_ref()
            if ddp is None:  # the DDP is gone; the module's parameters live on without it
                return
            # Decided at forward time, as torch's prepare_for_backward: a forward outside
            # no_sync() is reduced even when its backward runs inside the block.
            if ddp._expect_hooks:
                clock = ddp._ready_clock
                if clock is None:
                    ddp._on_ready(index, param)
                else:
                    entered = clock.enter()
                    ddp._on_ready(index, param)
                    clock.leave(index, entered)
            elif ddp.find_unused_parameters and param.grad is not None:
                # torch's locally-used map: a gradient accumulated under no_sync() counts as used
                # until the synchronizing backward, which reduces it on every rank. (The hook also
                # fires, .grad None, for a parameter behind an output the loss left out.)
                ddp._used_in_window.add(index)
        return hook

    def _on_ready(self, index: int, param) -> None:
        # Runs once per gradient inside autograd: keep it to the state transition plus, for a big
        # gradient, torch's fused copy-and-scale; small gradients are copied per bucket at launch.
        state = self._state
        if not state.num_ready:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if self._static_unused is not None and index in self._static_unused:
            raise self._logged(RuntimeError(
                "Your training graph has changed in this iteration, e.g., one parameter is unused in "
                "first iteration, but then got used in the second iteration. this is not compatible "
                f"with static_graph set to True. Parameter: {self._names[index]}"))
        if self.find_unused_parameters and param.grad is None:
            # Behind an output the loss left out (it came through the sink with no gradient):
            # locally unused, as torch's reducer decides from an undefined .grad.
            self._undefined_now.add(index)
        if self._buckets.fuse_at_hook[index]:
            try:
                self._buckets.copy_in_hook(index, param.grad, self._inv_div, self._iteration)
            except RuntimeError:
                refuse_sparse_in_dense(self._params, self._names, [index])  # a sparse gradient has no data_ptr
                raise
        try:
            state, launch = mark_ready(state, index)
        except RuntimeError:
            if state.ready_order and index in state.ready_order:
                raise self._logged(RuntimeError(marked_twice_message(index, self._names[index]))) from None
            raise
        if self._delaying:
            # static_graph's first iteration: only record; _finalize reduces everything at the end
            # (torch's delay_all_reduce), once it knows which parameters the graph leaves unused.
            object.__setattr__(self, "_state", state)
            return
        if self._pending_unused and not state.unused:
            state, more = mark_unused(state, self._pending_unused)
            launch += more
        # object.__setattr__: nn.Module.__setattr__ costs microseconds per call, once per gradient.
        object.__setattr__(self, "_state", state)
        if launch:
            self._launch_ready(launch, state)
        if launch and state.finished and self.find_unused_parameters and not self.static_graph:
            # torch all-reduces the local-used map right after the last bucket launches.
            used = torch.ones(len(self._params), dtype=torch.int32, device=self.device)
            for i in (*self._pending_unused, *self._undefined_now):
                if i not in self._used_in_window:
                    used[i] = 0
            self._local_used = used
            if not self.skip_all_reduce_unused_params:
                self._used_work = dist.all_reduce(used, group=self.process_group, async_op=True)

    def _launch_ready(self, launch: tuple[int, ...], state: ReducerState) -> None:
        """Reduce the buckets that just became ready, in order (torch's mark_bucket_ready), but
        with skip_all_reduce_unused_params a bucket whose parameters all went unused: its slot in
        ``_futures`` stays None and its gradients untouched, as torch skips it."""
        if launch[0] == 0 and self.logger.should_collect(self._iteration):
            self.logger.record("backward_comm_start")  # the first bucket is ready
        reduced = 0
        for b in launch:
            if self.skip_all_reduce_unused_params and state.unused.issuperset(self.bucket_plan.buckets[b].members):
                self._futures.append(None)
                continue
            self._launch(b)
            reduced += 1
        object.__setattr__(self, "_num_buckets_reduced", self._num_buckets_reduced + reduced)

    def _launch(self, b: int) -> None:
        if self.bucket_plan.buckets[b].sparse:
            self._launch_sparse(b)
            return
        try:
            self._buckets.fill(b, inv_div=self._inv_div, div_factor=self._div_factor, iteration=self._iteration)
        except RuntimeError:
            refuse_sparse_in_dense(self._params, self._names, self.bucket_plan.buckets[b].members)  # no data_ptr
            raise
        buf = self._buckets.flat[b]
        if self._comm_hook is None:
            fut = dist.all_reduce(buf, group=self.process_group, async_op=True).get_future()
        else:
            fut = self._run_comm_hook(b, buf)
        self._futures.append(fut)

    def _launch_sparse(self, b: int) -> None:
        """torch's ``mark_variable_ready_sparse`` then ``all_reduce_bucket`` for sparse bucket ``b``:
        the gradient itself, divided by the world size in place, all-reduced as a sparse tensor."""
        grad = self._sparse.gradient(self.bucket_plan.buckets[b].members[0], self._logged)
        if self._comm_hook is None:
            grad.div_(self._div_factor)
            fut = dist.all_reduce(grad, group=self.process_group, async_op=True).get_future()
        else:
            fut = self._run_comm_hook(b, grad)
        self._buckets.flat[b] = grad
        self._futures.append(fut)

    def _run_comm_hook(self, b: int, buf: torch.Tensor):
        """The registered comm hook on bucket ``b`` with ``buf`` as its flat buffer (DDP's own
        buffer, or zeros when a joined rank shadows the others' backward)."""
        state, hook = self._comm_hook
        fut = hook(state, self._buckets.grad_bucket(b, buf))
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future and get_future()'s C type
            raise RuntimeError("Communication hook: callback must return a torch.futures.Future "
                               f"object, but got {type(fut).__name__}.")
        return fut

    def _finalize(self) -> None:
        state = self._state
        timed = self.logger.should_collect(self._iteration)
        delayed = self.static_graph and self._static_unused is None
        if delayed:
            state = self._delay_all_reduce(state, timed)
        elif state.finished and timed:
            self.logger.record("backward_compute_end")
        if not state.finished:
            return  # reported by the next forward, as torch does
        # Without unused parameters, each bucket's gradients are written back as soon as that
        # bucket is reduced, while later buckets are still in flight (torch's finalize_backward
        # order); with unused ones, which to skip is known only once every bucket is in.
        unused = set(state.unused).union(self._undefined_now) if self._undefined_now else state.unused
        stream = not unused and not self._comm_hook_owns_grads and not self._grads_in_buckets
        skipped = {b for b, fut in enumerate(self._futures) if fut is None}
        for b, fut in enumerate(self._futures):
            if fut is None:
                continue  # skipped: its parameters all went unused (skip_all_reduce_unused_params)
            with naming(f"DistributedDataParallel backward: the {self._reduction_name} of gradient bucket {b}",
                        user_code=self._comm_hook is not None):
                value = fut.wait()
            value = _hook_tensor(value, b)
            if self.bucket_plan.buckets[b].sparse:
                # .grad reduced in place: nothing to write back
                self._sparse.finish(self.bucket_plan.buckets[b].members[0], self._buckets.flat[b], value, self._logged)
                continue
            self._buckets.take_result(b, value)
            if stream:
                self._buckets.write_back(b, frozenset())
        self._sparse.end_reduction()
        globally_unused = set()
        if unused and self._static_globally_unused is not None:
            globally_unused = self._static_globally_unused
        elif unused:
            if self._used_work is not None:
                with naming("DistributedDataParallel backward: the all-reduce of the used-parameter map"):
                    self._used_work.wait()
            globally_unused = {i for i in unused if int(self._local_used[i]) == 0}
            if self.static_graph:
                self._static_globally_unused = globally_unused
        # Nothing to do when streamed above, or for a ZeRO-2 hook (it keeps only its gradient
        # slice: .grad stays None).
        if stream or self._comm_hook_owns_grads:
            pass
        elif self._grads_in_buckets:
            self._buckets.grads_to_views(globally_unused.union(*(self.bucket_plan.buckets[b].members
                                                                 for b in skipped)))
        else:
            for b in range(len(self.bucket_plan.buckets)):
                if b not in skipped:
                    self._buckets.write_back(b, globally_unused)
        if self._last_order is None and not delayed:
            # The order the next forward rebuilds the buckets from. torch's static_graph records it
            # in its second iteration (the first one's hooks only count), the unused parameters
            # last, by index.
            self._last_order = state.ready_order if not self.static_graph else (
                tuple(i for i in state.ready_order if i not in state.unused) + tuple(sorted(state.unused)))
            if self._ready_clock is not None:
                self._last_ready_s = self._ready_clock.times()  # of the iteration whose order it is
        self._buckets.release_in_place()
        self._futures = []
        self._used_in_window.clear()
        self._undefined_now = set()
        self._expect_hooks = False
        if timed:
            self.logger.record("backward_comm_end")
        if self._installed_futures:
            futs, self._installed_futures = self._installed_futures, []
            torch.futures.wait_all(futs)

    def _install_post_backward_futures(self, futs: list) -> None:
        """Wait for ``futs`` when the next synchronizing backward's reduction finishes."""
        self._installed_futures = [*self._installed_futures, *futs]

    @property
    def _reduction_name(self) -> str:
        return "all-reduce" if self._comm_hook is None else "communication hook's Future"

    def _delay_all_reduce(self, state: ReducerState, timed: bool) -> ReducerState:
        """static_graph, first iteration: unused = no hook fired; then every bucket, in order
        (not counted in ``num_buckets_reduced``, as torch's delay_all_reduce does not count them)."""
        if timed:
            self.logger.record("backward_compute_end")
            self.logger.record("backward_comm_start")
        unused = state.missing()
        state, _ = mark_unused(state, unused)
        self._static_unused = unused
        self._pending_unused = unused
        object.__setattr__(self, "_state", state)
        for b in range(self.bucket_plan.num_buckets):
            self._launch(b)
        if unused:
            used = torch.ones(len(self._params), dtype=torch.int32, device=self.device)
            used[list(unused)] = 0
            self._local_used = used
            self._used_work = dist.all_reduce(used, group=self.process_group, async_op=True)
        return state

    # ---- the one rebuild ----------------------------------------------------------------------

    def _rebuild(self, ready_order) -> None:
        """Rebuild the plan once from the first iteration's ready order; rank 0's order wins.
        With ``bucket_cap_mb="auto"`` the plan is :func:`hybrid.torch.ddp._auto.plan_auto`'s."""
        order = self._ranks.rank0_order(ready_order)
        if self._auto_caps:
            plan, self._auto_report = plan_auto(
                self._ranks, self.bucket_plan.specs, order, self._last_ready_s, collectives=self._auto_collectives,
                in_place=not self._grads_in_buckets and self._mixed is None)
            self._ready_clock = None  # the times are in; the hooks stop reading the clock
        else:
            plan = rebuild_plan(self.bucket_plan, order, size_limits=self._rebuild_limits)
        self._ranks.check_same_plan(plan, self._layout_settings)
        self._set_plan(plan)
        self._has_rebuilt = True

    def _restore_rebuilt_plan(self, plan) -> None:
        """Take ``plan``, a rebuilt plan a checkpoint recorded, as this DDP's rebuilt plan: no
        rebuild follows, so the first step reduces in the saving run's buckets
        (``hybrid.checkpoint.torch.load(..., restore_buckets=True)``; every rank reads the same
        manifest, so the ranks agree without a collective)."""
        self._set_plan(plan)
        self._has_rebuilt = True
