"""The reducer of hybrid's DDP, torch's C++ ``Reducer``: a hook per parameter, the buckets launched
strictly in order as they fill, the end of the backward, and the buckets' one rebuild.

The per-iteration bookkeeping is the explicit ``ReducerState`` of ``hybrid.core._reducer_state``
(pure transitions); the tensors are :class:`BucketBuffers`', sparse gradients
:class:`SparseBuckets`', unused parameters :class:`UnusedParams`'. This class keeps the order and
issues the collectives.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybrid.core import BucketPlan, plan_buckets
from hybrid.core._reducer_state import ReducerState, mark_ready, mark_unused, start_iteration
from hybrid.torch._collectives import naming
from hybrid.torch.ddp._logging import nbytes
from hybrid.torch.ddp.reducer._buckets import BucketBuffers
from hybrid.torch.ddp.reducer._messages import marked_twice_message, unfinished_reduction_message
from hybrid.torch.ddp.reducer._rebuild import BucketRebuild
from hybrid.torch.ddp.reducer._sparse import SparseBuckets, refuse_sparse_in_dense
from hybrid.torch.ddp.reducer._unused import UnusedParams


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
    """The reducer over ``params`` (named ``names``: the DDP's reduced parameters in registration
    order), its first plan built from ``specs`` within ``initial_limits``.

    Owns its parts: ``buckets`` (:class:`BucketBuffers`: the plan and its tensors), ``rebuild``
    (:class:`BucketRebuild`: the recorded order and the one rebuild), the sparse and
    unused-parameter parts; the comm hook; the divisor; the per-iteration state (``iteration``,
    the ``ReducerState``, the launched futures, ``num_buckets_reduced``, futures a buffer hook
    installed). Settings it keeps: ``find_unused_parameters``, ``static_graph`` (until
    :meth:`set_static_graph`), ``skip_all_reduce_unused_params``; ``comm_hook_owns_grads`` is set
    by ZeRO2. Collectives go through ``ranks`` (a :class:`~hybrid.torch.ddp._sync.RankAgreement`),
    facts and errors into ``logger`` (the DDP's :class:`~hybrid.torch.ddp._logging.DDPLogger`).

    The DDP calls, per synchronizing step: :meth:`prepare_for_forward`, :meth:`maybe_rebuild`,
    :meth:`prepare_for_backward`; the gradient hooks and the end-of-backward callback do the rest.
    """

    def __init__(self, params: list[torch.Tensor], names: list[str], specs, *, ranks, logger,
                 layout_settings: dict, bucket_dtype: torch.dtype | None, grads_in_buckets: bool,
                 batched_grad_copy: bool, find_unused_parameters: bool, static_graph: bool,
                 skip_all_reduce_unused_params: bool, auto: bool, initial_limits, rebuild_limits):
        self._params, self._names = params, names
        self._ranks, self._logger = ranks, logger
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        # The user promises the same unused parameters on every rank: the used map stays local.
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self._grads_in_buckets = grads_in_buckets
        self.comm_hook: tuple[object, Callable] | None = None
        self.comm_hook_owns_grads = False  # set by hybrid.torch.ZeRO2, whose hook keeps the gradients
        self.set_divisor(ranks.world)
        self.iteration = 0  # synchronizing forwards so far (torch's num_iterations_)
        self._state: ReducerState | None = None
        self._delaying = False  # static_graph's first iteration: record only, reduce at the end
        self._expect_hooks = False  # decided at forward time, as torch's prepare_for_backward
        self._futures: list = []
        self.num_buckets_reduced = 0  # in the last synchronizing backward (torch's, for its logger)
        # Futures a buffer comm hook returned, waited for once the backward's reduction finishes
        # (torch's Reducer::install_futures).
        self._installed_futures: list = []
        # An in-place bucket is its gradient: not with gradient_as_bucket_view or a cast.
        self.rebuild = BucketRebuild(len(params), ranks, layout_settings, auto=auto, rebuild_limits=rebuild_limits,
                                     in_place=not grads_in_buckets and bucket_dtype is None)
        self._unused = UnusedParams(len(params), ranks, logger)
        self._sparse = SparseBuckets(params, names)
        self.buckets = BucketBuffers(params, ranks.device, bucket_dtype=bucket_dtype,
                                     grads_in_buckets=grads_in_buckets, batched_copy=batched_grad_copy)
        self._set_plan(plan_buckets(specs, size_limits=initial_limits))
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    @property
    def plan(self) -> BucketPlan:
        return self.buckets.plan

    def _set_plan(self, plan: BucketPlan) -> None:
        self.buckets.set_plan(plan)
        # The start state is an immutable value: every iteration on this plan starts from it.
        self._start_state = start_iteration(plan)

    def logged(self, error: Exception, *, python: bool = False) -> Exception:
        """``error``, first recorded as torch records the errors its DDP raises after construction:
        ``has_error``, the text (prefixed with the type for those torch raises from Python) and the
        current iteration count."""
        self._logger.set_error_and_log(f"{type(error)}: {error}" if python else str(error), iteration=self.iteration)
        return error

    # ---- what the DDP calls ---------------------------------------------------------------------

    def set_divisor(self, n: int) -> None:
        """Average over ``n`` ranks (the world; under Join, maybe the ranks still training)."""
        self._div_factor, self._inv_div = n, 1.0 / n

    def register_comm_hook(self, state: object, hook: Callable, *, builtin: bool = False) -> None:
        if self.comm_hook is not None:
            # torch's reducer names the method called first.
            names = ["register_comm_hook", "register_builtin_comm_hook"][::-1 if builtin else 1]
            raise self.logged(RuntimeError(f"{names[0]} or {names[1]} can only be called once."))
        self.comm_hook = (state, hook)
        self.buckets.use_comm_hook()

    def set_static_graph(self) -> None:
        """``static_graph`` from the next forward on: only before the first one (torch's reducer's error)."""
        if self.iteration > 0:
            raise self.logged(RuntimeError("set_static_graph() should be called before training loop starts "
                                           "and after DistributedDataParallel is constructed."))
        self.static_graph = True

    def set_sparse_metadata(self, global_unique_ids) -> None:
        self._sparse.set_metadata(global_unique_ids)

    def install_post_backward_futures(self, futs: list) -> None:
        """Wait for ``futs`` when the next synchronizing backward's reduction finishes."""
        self._installed_futures = [*self._installed_futures, *futs]

    def prepare_for_forward(self) -> None:
        """A synchronizing forward begins: the last iterations' stats logged, the iteration
        counted (torch's prepare_for_forward), the previous reduction checked finished."""
        self._log_runtime_stats()
        self.iteration += 1
        if self._logger.should_collect(self.iteration):
            self._logger.record("forward_start")
        state = self._state
        if self._expect_hooks and state is not None and state.started and not state.finished:
            raise self.logged(RuntimeError(unfinished_reduction_message(
                self._ranks.rank, state.missing(), self._names, static_graph=self.static_graph,
                find_unused_parameters=self.find_unused_parameters)))

    def prepare_for_backward(self, outputs) -> None:
        """A synchronizing forward ended with ``outputs``: the next backward is reduced (torch's
        prepare_for_backward), even if it runs inside ``no_sync()``."""
        if self._logger.should_collect(self.iteration):
            self._logger.record("backward_compute_start")
        if self.rebuild.clock is not None:
            self.rebuild.clock.reset()
        self._state = self._start_state
        self._delaying = self.static_graph and self._unused.static_unused is None
        self._futures = []
        self.num_buckets_reduced = 0
        self._unused.begin(outputs, self._params, find_unused_parameters=self.find_unused_parameters,
                           static_graph=self.static_graph, iteration=self.iteration)
        self._expect_hooks = True

    def _log_runtime_stats(self) -> None:
        """At a synchronizing forward, before it counts: the last synchronizing iteration's facts
        (torch's ``set_runtime_stats_and_log``; only sampled iterations are logged)."""
        if not self._logger.should_collect(self.iteration):
            return
        state = self._state
        # torch logs the order its gradient hooks fired in: not the unused parameters it marks
        # ready itself, and nothing for static_graph's first (delayed) iteration.
        order = () if state is None or self._delaying else [i for i in state.ready_order if i not in state.unused]
        self._logger.set_runtime_stats_and_log(
            iteration=self.iteration, num_buckets_reduced=self.num_buckets_reduced,
            unused_parameter_size=sum(nbytes(self._params[i]) for i in self._unused.pending),
            has_rebuilt_buckets=self.rebuild.has_rebuilt, buckets=self.buckets.param_bytes, grad_ready_order=order)

    # ---- the one rebuild ------------------------------------------------------------------------

    def maybe_rebuild(self) -> None:
        """Rebuild the buckets once, where torch does (a collective when it rebuilds)."""
        if self.rebuild.due(static_graph=self.static_graph, find_unused_parameters=self.find_unused_parameters):
            self._set_plan(self.rebuild.new_plan(self.plan))

    def restore_rebuilt_plan(self, plan: BucketPlan) -> None:
        """Take ``plan``, a rebuilt plan a checkpoint recorded, as the rebuilt plan: no rebuild
        follows (every rank reads the same manifest, so the ranks agree without a collective)."""
        self._set_plan(plan)
        self.rebuild.has_rebuilt = True

    # ---- the backward -------------------------------------------------------------------------

    def _make_hook(self, index: int):
        # The parameter holds its hook: a hook holding the reducer would make parameter -> hook ->
        # reducer -> parameter a reference cycle, which keeps the reducer and its process group
        # alive past destroy_process_group until some garbage collection, at worst the one at
        # interpreter exit, when gloo's worker threads can no longer take the GIL (the process
        # aborts). torch's DDP goes with its last reference; so does ours.
        reducer_ref = weakref.ref(self)

        def hook(param):
            reducer = reducer_ref()
            if reducer is None:  # the DDP is gone; the module's parameters live on without it
                return
            if reducer._expect_hooks:
                clock = reducer.rebuild.clock
                if clock is None:
                    reducer._on_ready(index, param)
                else:
                    entered = clock.enter()
                    reducer._on_ready(index, param)
                    clock.leave(index, entered)
            elif reducer.find_unused_parameters and param.grad is not None:
                # torch's locally-used map: a gradient accumulated under no_sync() counts as used
                # until the synchronizing backward, which reduces it on every rank. (The hook also
                # fires, .grad None, for a parameter behind an output the loss left out.)
                reducer._unused.used_in_window.add(index)
        return hook

    def _on_ready(self, index: int, param) -> None:
        # Runs once per gradient inside autograd: keep it to the state transition plus, for a big
        # gradient, torch's fused copy-and-scale; small gradients are copied per bucket at launch.
        state, unused = self._state, self._unused
        if not state.num_ready:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if unused.static_unused is not None and index in unused.static_unused:
            raise self.logged(RuntimeError(
                "Your training graph has changed in this iteration, e.g., one parameter is unused in "
                "first iteration, but then got used in the second iteration. this is not compatible "
                f"with static_graph set to True. Parameter: {self._names[index]}"))
        if self.find_unused_parameters and param.grad is None:
            # Behind an output the loss left out (it came through the sink with no gradient):
            # locally unused, as torch's reducer decides from an undefined .grad.
            unused.undefined.add(index)
        if self.buckets.fuse_at_hook[index]:
            try:
                self.buckets.copy_in_hook(index, param.grad, self._inv_div, self.iteration)
            except RuntimeError:
                refuse_sparse_in_dense(self._params, self._names, [index])  # a sparse gradient has no data_ptr
                raise
        try:
            state, launch = mark_ready(state, index)
        except RuntimeError:
            if state.ready_order and index in state.ready_order:
                raise self.logged(RuntimeError(marked_twice_message(index, self._names[index]))) from None
            raise
        if self._delaying:
            # static_graph's first iteration: only record; _finalize reduces everything at the end
            # (torch's delay_all_reduce), once it knows which parameters the graph leaves unused.
            self._state = state
            return
        if unused.pending and not state.unused:
            state, more = mark_unused(state, unused.pending)
            launch += more
        self._state = state
        if launch:
            self._launch_ready(launch, state)
        if launch and state.finished and self.find_unused_parameters and not self.static_graph:
            unused.share(all_reduce=not self.skip_all_reduce_unused_params)

    def _launch_ready(self, launch: tuple[int, ...], state: ReducerState) -> None:
        """Reduce the buckets that just became ready, in order (torch's mark_bucket_ready), but
        with skip_all_reduce_unused_params a bucket whose parameters all went unused: its slot in
        ``_futures`` stays None and its gradients untouched, as torch skips it."""
        if launch[0] == 0 and self._logger.should_collect(self.iteration):
            self._logger.record("backward_comm_start")  # the first bucket is ready
        reduced = 0
        for b in launch:
            if self.skip_all_reduce_unused_params and state.unused.issuperset(self.plan.buckets[b].members):
                self._futures.append(None)
                continue
            self._launch(b)
            reduced += 1
        self.num_buckets_reduced += reduced

    def _launch(self, b: int) -> None:
        bucket = self.plan.buckets[b]
        if bucket.sparse:
            # torch's mark_variable_ready_sparse: the gradient itself, divided in place, all-reduced
            buf = self._sparse.gradient(bucket.members[0], self.logged)
            if self.comm_hook is None:
                buf.div_(self._div_factor)
        else:
            try:
                self.buckets.fill(b, inv_div=self._inv_div, div_factor=self._div_factor, iteration=self.iteration)
            except RuntimeError:
                refuse_sparse_in_dense(self._params, self._names, bucket.members)  # no data_ptr: sparse
                raise
            buf = self.buckets.flat[b]
        if self.comm_hook is None:
            fut = dist.all_reduce(buf, group=self._ranks.group, async_op=True).get_future()
        else:
            fut = self._run_comm_hook(b, buf)
        if bucket.sparse:
            self.buckets.flat[b] = buf  # torch's bucket.gradients: the sparse gradient last launched
        self._futures.append(fut)

    def _run_comm_hook(self, b: int, buf: torch.Tensor):
        """The registered comm hook on bucket ``b`` with ``buf`` as its flat buffer (the bucket's
        own, or zeros when a joined rank shadows the others' backward)."""
        state, hook = self.comm_hook
        fut = hook(state, self.buckets.grad_bucket(b, buf))
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future and get_future()'s C type
            raise RuntimeError("Communication hook: callback must return a torch.futures.Future "
                               f"object, but got {type(fut).__name__}.")
        return fut

    def _finalize(self) -> None:
        state, unused_part = self._state, self._unused
        timed = self._logger.should_collect(self.iteration)
        delayed = self.static_graph and unused_part.static_unused is None
        if delayed:
            state = self._delay_all_reduce(state, timed)
        elif state.finished and timed:
            self._logger.record("backward_compute_end")
        if not state.finished:
            return  # reported by the next forward, as torch does
        # Without unused parameters, each bucket's gradients are written back as soon as that
        # bucket is reduced, while later buckets are still in flight (torch's finalize_backward
        # order); with unused ones, which to skip is known only once every bucket is in.
        unused = set(state.unused).union(unused_part.undefined) if unused_part.undefined else state.unused
        stream = not unused and not self.comm_hook_owns_grads and not self._grads_in_buckets
        skipped = {b for b, fut in enumerate(self._futures) if fut is None}
        reduction = "all-reduce" if self.comm_hook is None else "communication hook's Future"
        for b, fut in enumerate(self._futures):
            if fut is None:
                continue  # skipped: its parameters all went unused (skip_all_reduce_unused_params)
            with naming(f"DistributedDataParallel backward: the {reduction} of gradient bucket {b}",
                        user_code=self.comm_hook is not None):
                value = fut.wait()
            value = _hook_tensor(value, b)
            bucket = self.plan.buckets[b]
            if bucket.sparse:  # .grad reduced in place: nothing to write back
                self._sparse.finish(bucket.members[0], self.buckets.flat[b], value, self.logged)
                continue
            self.buckets.take_result(b, value)
            if stream:
                self.buckets.write_back(b, frozenset())
        self._sparse.end_reduction()
        globally_unused = unused_part.globally_unused(unused, static_graph=self.static_graph)
        # Nothing to do when streamed above, or for a ZeRO-2 hook (it keeps only its gradient
        # slice: .grad stays None).
        if stream or self.comm_hook_owns_grads:
            pass
        elif self._grads_in_buckets:
            self.buckets.grads_to_views(globally_unused.union(*(self.plan.buckets[b].members for b in skipped)))
        else:
            for b in range(self.plan.num_buckets):
                if b not in skipped:
                    self.buckets.write_back(b, globally_unused)
        if not delayed:
            self.rebuild.record(state, static_graph=self.static_graph)  # the order the next forward rebuilds from
        self.buckets.release_in_place()
        self._futures = []
        unused_part.end_iteration()
        self._expect_hooks = False
        if timed:
            self._logger.record("backward_comm_end")
        if self._installed_futures:
            futs, self._installed_futures = self._installed_futures, []
            torch.futures.wait_all(futs)

    def _delay_all_reduce(self, state: ReducerState, timed: bool) -> ReducerState:
        """static_graph, first iteration: unused = no hook fired; then every bucket, in order
        (not counted in ``num_buckets_reduced``, as torch's delay_all_reduce does not count them)."""
        if timed:
            self._logger.record("backward_compute_end")
            self._logger.record("backward_comm_start")
        unused = state.missing()
        state, _ = mark_unused(state, unused)
        self._unused.record_static(unused)
        self._state = state
        for b in range(self.plan.num_buckets):
            self._launch(b)
        self._unused.share_static()
        return state

    # ---- Join ---------------------------------------------------------------------------------

    def shadow_backward(self) -> None:
        """A joined rank's part in the others' reduction: the same collectives, in the same order,
        on zeros (torch's _match_all_reduce_for_bwd_pass)."""
        buckets = range(self.plan.num_buckets)
        if self.skip_all_reduce_unused_params:
            # The ranks still training skip each bucket whose parameters all went unused: the same
            # ones on every rank (the flag's promise), so this rank's last iteration names them.
            unused = set(self._unused.pending)
            buckets = [b for b in buckets if not unused.issuperset(self.plan.buckets[b].members)]
        if self.comm_hook is None:
            works = [dist.all_reduce(self.buckets.zero_bucket(b), group=self._ranks.group, async_op=True)
                     for b in buckets]
        else:
            # The hook runs on zero buckets, so that a hook whose collectives are not one
            # all-reduce of the bucket (fp16 compression, PowerSGD, ZeRO2's reduce-scatter) is
            # matched collective for collective.
            works = [self._run_comm_hook(b, self.buckets.zero_bucket(b)) for b in buckets]
        for w in works:
            w.wait()
        if self.find_unused_parameters and not self.static_graph and not self.skip_all_reduce_unused_params:
            self._unused.shadow_share()
