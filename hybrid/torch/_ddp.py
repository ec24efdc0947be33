"""A drop-in ``torch.nn.parallel.DistributedDataParallel`` whose buckets come from hybrid.core.

The layout (bucket membership, offsets, rebuild) is decided by ``hybrid.core``; the per-iteration
bookkeeping is ``hybrid.core._reducer_state``; this module only moves tensors and issues
``torch.distributed`` collectives.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from hybrid.core import BucketPlan, TensorSpec, canonical_dtype, ddp_size_limits, plan_buckets, rebuild_plan
from hybrid.core._reducer_state import ReducerState, mark_ready, mark_unused, start_iteration
from hybrid import kernels
from hybrid.torch import _compile  # issue 13: torch.compile(ddp) splits graphs

_MB = 1024 * 1024
_BROADCAST_BUCKET_BYTES = 250 * _MB  # torch DDP's broadcast_bucket_size


def _reduced_parameters(module: nn.Module, ignore=frozenset()) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs DDP reduces: requires_grad, not ignored, shared ones once.

    Same order as torch's ``_build_params_for_reducer`` (named_modules, then each module's own
    parameters), which fixes the registration order the bucket plan is built on.
    """
    out, memo = [], set()
    for mname, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if p.requires_grad and name not in ignore and p not in memo:
                memo.add(p)
                out.append((name, p))
    return out


def specs(module: nn.Module) -> list[TensorSpec]:
    """TensorSpecs of the parameters DDP reduces, in registration order.

    >>> [s.name for s in specs(torch.nn.Linear(2, 3))]
    ['weight', 'bias']
    """
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    return [TensorSpec(n, tuple(p.shape), canonical_dtype(p.dtype), str(p.device))
            for n, p in _reduced_parameters(module, ignore)]


class GradBucket:
    """The bucket a comm hook receives; the methods of ``torch.distributed.GradBucket``."""

    def __init__(self, index, buffer, gradients, parameters, is_last):
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._is_last = parameters, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer


def _find_tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    return []


def _reachable_params(outputs) -> set[int]:
    """ids of leaf tensors whose AccumulateGrad node is reachable from ``outputs``' graph."""
    seen, found = set(), set()
    stack = [t.grad_fn for t in _find_tensors(outputs) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            found.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


def _bucket_copy_backend(device: torch.device) -> str:
    """``"cuda"`` when copies between gradients and buckets on ``device`` go through
    :mod:`hybrid.kernels` (CUDA tensors, library built, unless ``HYBRID_KERNELS=reference``),
    else ``"reference"``: torch's own (foreach) copies, as on CPU.

    >>> _bucket_copy_backend(torch.device("cpu"))
    'reference'
    """
    if device.type != "cuda":
        return "reference"
    return kernels.resolve_backend(None, on_cuda=True)


def _unsupported(name, value, default):
    if value is not default and value != default:
        raise NotImplementedError(f"hybrid.torch.DistributedDataParallel does not support {name}={value!r}")


class DistributedDataParallel(nn.Module, Joinable):
    """torch's ``DistributedDataParallel``, with buckets planned by ``hybrid.core``.

    Same constructor; ``bucket_plan`` is the :class:`~hybrid.core.BucketPlan` in use (the initial
    one-bucket-per-dtype plan, then the plan rebuilt from the first iteration's ready order).

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> ddp(torch.ones(3, 4)).sum().backward()
    >>> ddp.module.weight.grad.shape, ddp.bucket_plan.num_buckets
    (torch.Size([2, 4]), 1)
    >>> dist.destroy_process_group()
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None):
        super().__init__()
        Joinable.__init__(self)
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce "
                             "need to be set at the same time.")
        _unsupported("delay_all_reduce_named_params", delay_all_reduce_named_params, None)
        _unsupported("mixed_precision", mixed_precision, None)
        _unsupported("device_mesh", device_mesh, None)
        _unsupported("skip_all_reduce_unused_params", skip_all_reduce_unused_params, False)
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                          "deprecated. Please avoid using it.", FutureWarning, stacklevel=2)
        self.process_group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = _reduced_parameters(module, self.parameters_to_ignore)
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        for mname, m in module.named_modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
                raise NotImplementedError(f"hybrid.torch.DistributedDataParallel does not support sparse "
                                          f"gradients ({mname or type(m).__name__} has sparse=True)")
        device_types = {p.device.type for _, p in named}
        if len(device_types) != 1:
            raise ValueError("DistributedDataParallel's input module must be on the same type of devices, "
                             f"but input module parameters locate in {device_types}.")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        if next(iter(device_types)) == "cpu" and (device_ids or output_device):
            raise ValueError("DistributedDataParallel device_ids and output_device arguments only work "
                             "with single-device/multiple-device GPU modules or CPU modules, but got "
                             f"device_ids {device_ids}, output_device {output_device}, and module "
                             f"parameters { {p.device for _, p in named} }.")
        self.device_ids = list(device_ids) if device_ids else None
        self.output_device = output_device if output_device is not None else (device_ids[0] if device_ids else None)
        self.module = module
        self.dim = dim
        self.device = named[0][1].device
        if broadcast_buffers is not None and forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=2)
        elif broadcast_buffers is not None:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
                          "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` "
                          "still syncs buffers at init.", FutureWarning, stacklevel=2)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers is None or bool(broadcast_buffers)
        self.broadcast_buffers = self.forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._buffers_to_sync = [b for n, b in module.named_buffers() if n not in self.parameters_to_ignore]
        self._world = dist.get_world_size(self.process_group)
        self._rank = dist.get_rank(self.process_group)
        self._set_div_factor(self._world)
        self._divide_by_initial_world_size = True
        self.batched_grad_copy = batched_grad_copy
        self._iteration = 0
        self._delaying = False
        self._init_sync_buffers = init_sync_buffers

        if bucket_cap_mb_list:
            caps = tuple(int(mb * _MB) for mb in bucket_cap_mb_list)
            self._initial_limits, self._rebuild_limits = ddp_size_limits(
                bucket_caps_bytes=caps, static_graph=static_graph, find_unused_parameters=find_unused_parameters)
        else:
            self._initial_limits, self._rebuild_limits = ddp_size_limits(
                bucket_cap_bytes=None if bucket_cap_mb is None else int(bucket_cap_mb * _MB),
                static_graph=static_graph, find_unused_parameters=find_unused_parameters)

        if init_sync:
            self._verify_same_model()
            self._init_sync_buffers = init_sync_buffers
            self._sync_module_states(0)

        self._comm_hook: tuple[object, Callable] | None = None
        self._has_rebuilt = False
        self._state: ReducerState | None = None
        self._static_unused: tuple[int, ...] | None = None  # static_graph: found in iteration 1
        self._static_globally_unused: set[int] | None = None
        self._futures: list = []
        self._used_work = None
        self._set_plan(plan_buckets(specs(module), size_limits=self._initial_limits))
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    # ---- plan and buffers -------------------------------------------------------------------

    def _set_plan(self, plan: BucketPlan) -> None:
        self.bucket_plan = plan
        self._bufs, self._views = [], [None] * len(self._params)
        for bucket in plan.buckets:
            p0 = self._params[bucket.members[0]]
            buf = torch.zeros(bucket.length, dtype=p0.dtype, device=p0.device)
            self._bufs.append(buf)
            for m, view in zip(bucket.members, self._bucket_views(bucket, buf)):
                self._views[m] = view
        if self.gradient_as_bucket_view:
            # torch's initialize_bucket_views: an existing gradient moves into the bucket.
            for p, v in zip(self._params, self._views):
                if p.grad is not None:
                    v.copy_(p.grad)
                    p.grad = v
        self._bucket_is_last = [b == len(plan.buckets) - 1 for b in range(len(plan.buckets))]
        # The start state is an immutable value: every iteration on this plan starts from it.
        self._start_state = start_iteration(plan)
        self._scaled_in = [-1] * len(self._params)  # iteration in which a hook already scaled it
        self._kernel_copy = _bucket_copy_backend(self.device) == "cuda"
        self._update_copy_policy()

    def _bucket_views(self, bucket, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each member's gradient as a view into ``buf`` laid out as ``bucket`` says."""
        return [buf[o:o + n].view(self._params[m].shape)
                for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels)]

    def _update_copy_policy(self) -> None:
        """Which gradients the hook copies (fused with the scale) rather than ``_fill_bucket``."""
        fuse = not (self.batched_grad_copy or self._kernel_copy or self._comm_hook is not None)
        self._fuse_at_hook = [fuse and p.numel() >= self._FUSED_SCALE_NUMEL for p in self._params]

    def _set_div_factor(self, n: int) -> None:
        self._div_factor, self._inv_div = n, 1.0 / n

    def _verify_same_model(self) -> None:
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._names, self._params)]
        if self._world == 1:
            return
        everyone = [None] * self._world
        dist.all_gather_object(everyone, mine, group=self.process_group)
        ref = everyone[0]
        for r, theirs in enumerate(everyone):
            if len(theirs) != len(ref):
                raise RuntimeError(
                    f"DDP expects same model across all ranks, but Rank {self._rank} has {len(mine)} params, "
                    f"while rank {r} has inconsistent {len(theirs)} params (rank 0 has {len(ref)}).")
            for i, (a, b) in enumerate(zip(ref, theirs)):
                if a[1:] != b[1:]:
                    raise RuntimeError(
                        f"DDP expects same model across all ranks, but rank {r}'s params[{i}] ({b[0]!r}) "
                        f"has sizes {list(b[1])} and dtype {b[2]}, while rank 0's ({a[0]!r}) has "
                        f"sizes {list(a[1])} and dtype {a[2]}.")

    def _rebuild(self, ready_order) -> None:
        """Rebuild the plan once from the first iteration's ready order; rank 0's order wins."""
        order = torch.tensor(list(ready_order), dtype=torch.int64)
        if self._world > 1:
            n = torch.tensor([order.numel()], dtype=torch.int64)
            dist.broadcast(n, 0, group=self.process_group)
            if order.numel() != n.item():
                order = torch.zeros(int(n.item()), dtype=torch.int64)
            dist.broadcast(order, 0, group=self.process_group)
        plan = rebuild_plan(self.bucket_plan, order.tolist(), size_limits=self._rebuild_limits)
        if self._world > 1:
            fp = torch.tensor([int(plan.fingerprint(), 16) >> 1], dtype=torch.int64)
            fps = [torch.zeros_like(fp) for _ in range(self._world)]
            dist.all_gather(fps, fp, group=self.process_group)
            if len({int(f) for f in fps}) != 1:
                raise RuntimeError(f"ranks disagree on the rebuilt bucket plan: fingerprints {[int(f) for f in fps]}")
        self._set_plan(plan)
        self._has_rebuilt = True

    def _sync_module_states(self, src: int) -> None:
        """torch's _sync_module_states: parameters (and buffers) from ``src`` to every rank."""
        if self._world == 1:
            return
        tensors = [p.detach() for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
        if self._init_sync_buffers:
            tensors += [b.detach() for b in self._buffers_to_sync]
        if tensors:
            dist._broadcast_coalesced(self.process_group, tensors, _BROADCAST_BUCKET_BYTES, src)

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        rank = torch.tensor([input_rank if rank_cond else -1], device=self.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(rank.item())

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        # The order of collectives below is torch's _pre_forward's; a joined rank's _JoinHook
        # issues the matching ones in the same order.
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if grad_sync:
            self._ensure_prior_reduction_finished()
        work = Join.notify_join_context(self)
        if work is not None:
            work.wait()
            self._set_div_factor(self._world if self._divide_by_initial_world_size
                                 else int(work.result()[0].item()))
        if torch.is_grad_enabled():
            self._maybe_rebuild()
        if self.require_forward_param_sync and self.forward_sync_buffers and self._buffers_to_sync:
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        # issue 13: under torch.compile the module runs compiled in pieces split at the bucket
        # boundaries (hybrid/torch/_compile.py); eagerly it is self.module(*inputs, **kwargs).
        out = _compile.forward_module(self, inputs, kwargs)
        if grad_sync:
            self._state = self._start_state
            self._iteration += 1
            self._delaying = self.static_graph and self._static_unused is None
            self._futures = []
            self._pending_unused = ()
            if self.find_unused_parameters and not self.static_graph:
                reach = _reachable_params(out)
                self._pending_unused = tuple(i for i, p in enumerate(self._params) if id(p) not in reach)
            elif self.static_graph and self._static_unused is not None:
                self._pending_unused = self._static_unused  # found in the first iteration
            self._expect_hooks = True
        return out

    def _maybe_rebuild(self) -> None:
        if (not self._has_rebuilt and self._last_order is not None
                and (self.static_graph or not self.find_unused_parameters)):
            self._rebuild(self._last_order)

    _last_order = None
    _expect_hooks = False
    _comm_hook_owns_grads = False  # set by hybrid.torch.ZeRO2, whose hook keeps the gradients

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool):
        # Inside a Join context every rank takes part in this all-reduce, so joined ranks learn
        # whether the ranks still stepping will run a synchronized backward (torch's protocol).
        flag = torch.ones(1, device=self.device) if (not is_joined_rank and self.require_backward_grad_sync) \
            else torch.zeros(1, device=self.device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if is_joined_rank:
            work.wait()
            return flag.item() != 0
        return None

    def _sync_buffers(self, rank_cond: bool = True):
        # Under Join, rank 0 may have joined with stale buffers: the highest active rank broadcasts.
        src = self._find_common_rank(self._rank, rank_cond) if self._join_config.enable else 0
        if self._world > 1:
            with torch.no_grad():
                dist._broadcast_coalesced(self.process_group, [b.detach() for b in self._buffers_to_sync],
                                          _BROADCAST_BUCKET_BYTES, src)

    def _ensure_prior_reduction_finished(self):
        state = self._state
        if self._expect_hooks and state is not None and state.started and not state.finished:
            missing = state.missing()
            # torch's two texts: with static_graph a missing gradient means the graph changed.
            why = ("This error indicates that your training graph has changed in this iteration, e.g., "
                   "one parameter is used in first iteration, but then got unused in the second "
                   "iteration. this is not compatible with static_graph set to True.\n"
                   if self.static_graph else
                   "This error indicates that your module has parameters that were not used in producing "
                   "loss. You can enable unused parameter detection by passing the keyword argument "
                   "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by "
                   "making sure all `forward` function outputs participate in calculating loss.\n")
            raise RuntimeError(
                "Expected to have finished reduction in the prior iteration before starting a new one. "
                + why +
                f"Parameter indices which did not receive grad for rank {self._rank}: "
                f"{' '.join(map(str, missing))}\n"
                f"Parameters which did not receive grad for rank {self._rank}: "
                f"{', '.join(self._names[i] for i in missing)}")

    # ---- backward ---------------------------------------------------------------------------

    def _make_hook(self, index: int):
        on_ready = self._on_ready  # bound once, not on every gradient

        def hook(param):
            if self._expect_hooks and self.require_backward_grad_sync:
                on_ready(index, param)
        return hook

    def _on_ready(self, index: int, param) -> None:
        # Runs once per gradient inside autograd: keep it to the state transition plus, for a big
        # gradient, torch's fused copy-and-scale; small gradients are copied per bucket at launch.
        state = self._state
        if not state.num_ready:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if self._static_unused is not None and index in self._static_unused:
            raise RuntimeError(
                "Your training graph has changed in this iteration, e.g., one parameter is unused in "
                "first iteration, but then got used in the second iteration. this is not compatible "
                f"with static_graph set to True. Parameter: {self._names[index]}")
        if self._fuse_at_hook[index]:
            grad, view = param.grad, self._views[index]
            if grad is not None and grad.data_ptr() != view.data_ptr():
                torch.mul(grad, self._inv_div, out=view)
                self._scaled_in[index] = self._iteration
        state, launch = mark_ready(state, index)
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
        for b in launch:
            self._launch(b)
        if launch and state.finished and self.find_unused_parameters and not self.static_graph:
            # torch all-reduces the local-used map right after the last bucket launches.
            used = torch.ones(len(self._params), dtype=torch.int32, device=self.device)
            for i in self._pending_unused:
                used[i] = 0
            self._local_used = used
            self._used_work = dist.all_reduce(used, group=self.process_group, async_op=True)

    # From this many elements on, scaling while copying in the hook (one pass over memory, torch's
    # mul_out) beats a batched copy and a multiply at launch; below it per-call overhead dominates.
    _FUSED_SCALE_NUMEL = 1 << 16

    def _fill_bucket(self, b: int) -> None:
        """Bring bucket ``b``'s gradients into its buffer, divided by the world size when no comm
        hook runs (a hook divides itself), as torch does: x * (1/n) for copied gradients (mul_out),
        x / n for gradients already living in the bucket (``gradient_as_bucket_view``: div_)."""
        members = self.bucket_plan.buckets[b].members
        params, views, it, scaled_in = self._params, self._views, self._iteration, self._scaled_in
        dst, src, in_place = [], [], []
        for m in members:
            if scaled_in[m] == it:
                continue  # copied and scaled in its hook
            grad, view = params[m].grad, views[m]
            if grad is None:
                view.zero_()  # an unused parameter contributes zeros; zero stays zero
            elif grad.data_ptr() == view.data_ptr():
                in_place.append(view)
            else:
                dst.append(view)
                src.append(grad)
        scale = self._comm_hook is None
        if dst:
            if self._kernel_copy and len(dst) == len(members):
                # One launch for the whole bucket, the scale fused in (hybrid.kernels).
                kernels.gather(self.bucket_plan, b, [p.grad for p in params], out=self._bufs[b],
                               scale=self._inv_div if scale else None, backend="cuda")
                return
            torch._foreach_copy_(dst, src)
            if scale:
                if len(dst) == len(members):
                    self._bufs[b].mul_(self._inv_div)  # one op for a bucket of many small grads
                else:
                    torch._foreach_mul_(dst, self._inv_div)
        if in_place and scale:
            if len(in_place) == len(members):
                self._bufs[b].div_(self._div_factor)
            else:
                torch._foreach_div_(in_place, self._div_factor)

    def _launch(self, b: int) -> None:
        self._fill_bucket(b)
        buf = self._bufs[b]
        if self._comm_hook is None:
            fut = dist.all_reduce(buf, group=self.process_group, async_op=True).get_future()
        else:
            fut = self._run_comm_hook(b, buf)
        self._futures.append(fut)

    def _run_comm_hook(self, b: int, buf: torch.Tensor):
        """The registered comm hook on bucket ``b`` with ``buf`` as its flat buffer (DDP's own
        buffer, or zeros when a joined rank shadows the others' backward)."""
        state, hook = self._comm_hook
        spec = self.bucket_plan.buckets[b]
        views = ([self._views[m] for m in spec.members] if buf is self._bufs[b]
                 else self._bucket_views(spec, buf))
        bucket = GradBucket(b, buf, views, [self._params[m] for m in spec.members], self._bucket_is_last[b])
        fut = hook(state, bucket)
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future and get_future()'s C type
            raise RuntimeError("Communication hook: callback must return a torch.futures.Future "
                               f"object, but got {type(fut).__name__}.")
        return fut

    def _finalize(self) -> None:
        state = self._state
        if self.static_graph and self._static_unused is None:
            state = self._delay_all_reduce(state)
        if not state.finished:
            return  # reported by the next forward, as torch does
        # Without unused parameters, each bucket's gradients are written back as soon as that
        # bucket is reduced, while later buckets are still in flight (torch's finalize_backward
        # order); with unused ones, which to skip is known only once every bucket is in.
        stream = not state.unused and not self._comm_hook_owns_grads and not self.gradient_as_bucket_view
        for b, fut in enumerate(self._futures):
            value = fut.wait()
            if isinstance(value, (list, tuple)):
                value = value[0]
            if isinstance(value, torch.Tensor) and value.data_ptr() != self._bufs[b].data_ptr():
                self._bufs[b].copy_(value.view(-1)[: self._bufs[b].numel()])
            if stream:
                self._write_back(b, frozenset())
        globally_unused = set()
        if state.unused and self._static_globally_unused is not None:
            globally_unused = self._static_globally_unused
        elif state.unused:
            if self._used_work is not None:
                self._used_work.wait()
            globally_unused = {i for i in state.unused if int(self._local_used[i]) == 0}
            if self.static_graph:
                self._static_globally_unused = globally_unused
        # Nothing to do when streamed above, or for a ZeRO-2 hook (it keeps only its gradient
        # slice: .grad stays None).
        if stream or self._comm_hook_owns_grads:
            pass
        elif self.gradient_as_bucket_view:
            for i, (p, view) in enumerate(zip(self._params, self._views)):
                if i not in globally_unused and (p.grad is None or p.grad.data_ptr() != view.data_ptr()):
                    p.grad = view
        else:
            for b in range(len(self.bucket_plan.buckets)):
                self._write_back(b, globally_unused)
        if self._last_order is None:
            self._last_order = tuple(i for i in state.ready_order if i not in state.unused) \
                if self.static_graph else state.ready_order
        self._futures = []
        self._expect_hooks = False

    def _write_back(self, b: int, skip: Set[int]) -> None:
        """Reduced bucket ``b`` into its parameters' ``.grad`` (torch's copy_bucket_to_grad), in
        one call: a kernel launch on CUDA (hybrid.kernels), a foreach copy on CPU."""
        params, views, members = self._params, self._views, self.bucket_plan.buckets[b].members
        grads = [params[m].grad for m in members]
        if (self._kernel_copy and not skip.intersection(members)
                and all(g is not None and g.is_contiguous() for g in grads)):
            kernels.scatter(self.bucket_plan, b, self._bufs[b], [p.grad for p in params], backend="cuda")
            return
        dst, src = [], []
        for m, g in zip(members, grads):
            if m in skip:
                continue
            if g is None:
                params[m].grad = views[m].clone()
            else:
                dst.append(g)
                src.append(views[m])
        if dst:
            torch._foreach_copy_(dst, src)

    def _delay_all_reduce(self, state: ReducerState) -> ReducerState:
        """static_graph, first iteration: unused = no hook fired; then every bucket, in order."""
        unused = state.missing()
        state, _ = mark_unused(state, unused)
        self._static_unused = unused
        self._pending_unused = unused
        object.__setattr__(self, "_state", state)
        for b in range(len(self._bufs)):
            self._launch(b)
        if unused:
            used = torch.ones(len(self._params), dtype=torch.int32, device=self.device)
            used[list(unused)] = 0
            self._local_used = used
            self._used_work = dist.all_reduce(used, group=self.process_group, async_op=True)
        return state

    # ---- torch API --------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block reduces them all."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Use ``hook(state, bucket) -> Future`` instead of the built-in all-reduce (torch's protocol)."""
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._comm_hook = (state, hook)
        self._update_copy_policy()

    def _get_ddp_logging_data(self):
        return {"bucket_sizes": [b.nbytes for b in self.bucket_plan.buckets]}

    # ---- Join -------------------------------------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """torch's ``DistributedDataParallel.join``: a ``Join`` context over this module alone."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group


class _JoinHook(JoinHook):
    """Shadows a still-training rank's collectives from a rank that ran out of data."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self):
        # Same collectives, same order, as one forward + backward of a rank that still steps.
        ddp = self.ddp
        ddp._maybe_rebuild()
        if ddp.require_forward_param_sync and ddp.forward_sync_buffers and ddp._buffers_to_sync:
            ddp._sync_buffers(rank_cond=False)
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        if ddp._comm_hook is None:
            works = [dist.all_reduce(torch.zeros_like(buf), group=ddp.process_group, async_op=True)
                     for buf in ddp._bufs]
        else:
            # torch's _match_all_reduce_for_bwd_pass: the hook runs on zero buckets, so that a
            # hook whose collectives are not one all-reduce of the bucket (fp16 compression,
            # PowerSGD, ZeRO2's reduce-scatter) is matched collective for collective.
            works = [ddp._run_comm_hook(b, torch.zeros_like(buf)) for b, buf in enumerate(ddp._bufs)]
        for w in works:
            w.wait()
        if ddp.find_unused_parameters and not ddp.static_graph:
            dist.all_reduce(torch.zeros(len(ddp._params), dtype=torch.int32, device=ddp.device),
                            group=ddp.process_group)

    def post_hook(self, is_last_joiner: bool):
        # torch's _sync_final_model: the last rank to join holds the final model.
        ddp = self.ddp
        src = ddp._find_common_rank(ddp._rank, is_last_joiner)
        ddp._sync_module_states(src)
