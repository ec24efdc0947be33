"""When ZeRO-3 gathers, prefetches and frees each bucket, driven by module hooks.

The hooks sit on *units* (``_units``): eager, every module holding parameters of its own; under
``torch.compile``, a block compiled before wrapping, or each block of a model compiled whole, with
the parameters of every module under it. A unit *needs* the buckets holding those parameters
(``module._parameters``; a tied parameter is needed by every unit that holds it) and those declared
for them (``external_params``). Under compile every hook runs as a graph break, never traced. Its
forward pre-hook gathers them (starting the gathers of the next ``prefetch`` buckets in the forward
order before waiting) and puts the working parameters (views into the gathered buckets) in the
module's ``_parameters``; its forward hook puts the user's sharded stand-ins back, and frees a
bucket once every module that needs it has run in this forward. The backward mirrors it: a hook on
the module's outputs fires when their gradient arrives, just before the module's own backward,
and gathers its buckets again (and prefetches the next ones in the reverse order); a bucket is
freed once its gradients are all accumulated (``_grads``).

A parameter read anywhere else while a forward runs (a parent's ``x @ self.emb.weight.T``, a
sibling, a functional op) reaches its stand-in, which asks :meth:`Schedule.working` for the working
parameter: its bucket is gathered if it is not, and kept until its gradients are reduced (or,
without autograd, until the forward ends), so the backward of that read finds it. Autograd sees one
leaf per parameter wherever it is read, so each gradient is accumulated, and reduced, once.

A forward is a *session*: ``ZeRO3.forward`` opens one, and so does a call of the inner module (or of
any module holding parameters) outside one, which runs as the same gathers. Inside
``ZeRO3.gathered()`` every bucket is *pinned*: the hooks neither gather, swap nor free; the
modules keep the stand-ins, and every read of one computes with its working parameter (so a
reference taken inside is a stand-in again after the block, never a view of freed memory).

The forward order is :func:`hybrid.core.forward_order` of the parameters' first uses observed in
the latest forward from the root (before any: the plan's reverse, which is registration order).
Every rank runs the same forward, so every rank issues the same gathers in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from hybrid.core import BucketPlan, forward_order
from hybrid.torch.zero.zero3._grads import GradReducer
from hybrid.torch.zero.zero3._params import READY, ParamBuckets
from hybrid.torch.zero.zero3._units import select_units


def _eager(fn):
    """``fn`` run by dynamo as a graph break, never traced (FSDP2's hooks under
    ``torch._dynamo.config.skip_fsdp_hooks``): it issues collectives and swaps parameters."""
    return torch._dynamo.disable(fn, recursive=True)


def _members(unit: nn.Module, units: set[int]) -> list[nn.Module]:
    """``unit`` and the modules under it that no other unit (nearer to them) covers."""
    found, stack, seen = [], [unit], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        found.append(m)
        stack.extend(c for c in reversed(list(m.children())) if id(c) not in units)
    return found


class Schedule:
    """The module hooks of a ZeRO3 model and the per-pass state they share.

    Args:
      module: the root module (hooked even if it holds no parameter: a call of it opens a session).
      plan, index_of: the bucket plan and the spec index of each sharded parameter (by ``id``).
      buckets, grads: the parameter buckets and the gradient reducer.
      declared: ``{module: spec indices}`` each module needs besides its own parameters.
      on_implicit_forward: called before a forward that no ``ZeRO3.forward`` opened (the call check).
      keep_for_backward: keep the forward's last bucket gathered for the backward, which starts
        with it (speed), or free it with the others and gather it again (memory).
    """

    def __init__(self, module: nn.Module, plan: BucketPlan, index_of: dict[int, int], buckets: ParamBuckets,
                 grads: GradReducer, *, prefetch: int, reshard_after_forward: bool,
                 declared: dict[nn.Module, tuple[int, ...]], on_implicit_forward: Callable[[], None],
                 keep_for_backward: bool = True):
        self.plan, self.buckets, self.grads, self.root = plan, buckets, grads, module
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.on_implicit_forward = on_implicit_forward
        self.keep_for_backward = keep_for_backward  # the forward's last bucket, which the backward starts with
        self._index_of, self._declared = index_of, declared
        self._handles: list = []
        self.whole_compiled: bool | None = None
        self.hook_units(whole_compiled=False)
        self._set_order(forward_order(plan))
        self.session: str | None = None  # "forward" (ZeRO3.forward's), "implicit", or None
        self._implicit_owner: nn.Module | None = None
        self._pins = 0
        self._running: list[nn.Module] = []
        self._kept: set[int] = set()  # buckets read outside their modules: kept for the backward
        self._first_use: list[int] = []
        self._seen: set[int] = set()
        self._done: list[set[nn.Module]] = [set() for _ in plan.buckets]

    def hook_units(self, *, whole_compiled: bool) -> None:
        """Hook the units (``_units``): eager, every module holding parameters; ``whole_compiled``:
        the blocks a ``torch.compile`` of the whole model should run as single graphs. Between
        forwards only (the tables below are the state of a forward's hooks)."""
        if whole_compiled == self.whole_compiled:
            return
        for h in self._handles:
            h.remove()
        self.whole_compiled = whole_compiled
        index_of, plan = self._index_of, self.plan

        def own(m: nn.Module) -> list[tuple[nn.Module, str, int]]:
            return [(m, name, index_of[id(p)]) for name, p in m._parameters.items()
                    if p is not None and id(p) in index_of]

        def holds(m: nn.Module) -> bool:
            return bool(own(m)) or bool(self._declared.get(m))

        # The old units' needs stay: a backward of an output made before the change still asks
        # its unit's buckets back through them.
        self.needs: dict[nn.Module, tuple[int, ...]] = dict(getattr(self, "needs", {}))
        self._specs_of: dict[nn.Module, tuple[int, ...]] = {}
        # per unit: (module, attribute, spec index) of every parameter it puts in place
        self._owned: dict[nn.Module, list[tuple[nn.Module, str, int]]] = {}
        self._users: list[set[nn.Module]] = [set() for _ in plan.buckets]
        self._user_params: dict[int, nn.Parameter] = {}
        units = select_units(self.root, holds, whole_compiled=whole_compiled)
        for u in units:
            members = _members(u, {id(x) for x in units})
            owned = [entry for m in members for entry in own(m)]
            mine = {i for _, _, i in owned}
            extra = tuple(dict.fromkeys(i for m in members for i in self._declared.get(m, ()) if i not in mine))
            for m, name, i in owned:
                self._user_params[i] = m._parameters[name]
            specs = tuple(dict.fromkeys(i for _, _, i in owned)) + extra
            bs = tuple(sorted({plan.locate(i)[0] for i in specs}))
            self.needs[u], self._specs_of[u], self._owned[u] = bs, specs, owned
            for b in bs:
                self._users[b].add(u)
            # Graph breaks under torch.compile: dynamo runs the hooks, never traces them.
            self._handles.append(u.register_forward_pre_hook(_eager(self._pre_forward)))
            # always_call: a module that raises still gives its parameters back and closes its session.
            self._handles.append(u.register_forward_hook(_eager(self._post_forward), always_call=True))

    def _set_order(self, order: tuple[int, ...]) -> None:
        self.order = order
        self._fwd_pos = {b: k for k, b in enumerate(order)}
        self._bwd_order = order[::-1]
        self._bwd_pos = {b: k for k, b in enumerate(self._bwd_order)}

    @property
    def pinned(self) -> bool:
        return self._pins > 0

    # -- sessions ---------------------------------------------------------------------------------

    def begin_forward(self, *, implicit_owner: nn.Module | None = None) -> None:
        if not self.pinned:
            # Buckets still gathered from a forward that no backward followed hold values from
            # before any later change of the slices (a step, a load): gather afresh.
            self.buckets.free_all()
        self.session = "forward" if implicit_owner is None else "implicit"
        self._implicit_owner = implicit_owner
        self._first_use, self._seen, self._kept, self._running = [], set(), set(), []
        self._done = [set() for _ in self.plan.buckets]

    def end_forward(self, output, *, learn: bool = True):
        """After the forward: learn the order, free what the backward does not start with; the
        output is returned with any tensor that aliases a gathered bucket copied out of it."""
        self.session, self._implicit_owner = None, None
        if learn and self._first_use:
            order = forward_order(self.plan, first_use=self._first_use)
            if order != self.order:
                self._set_order(order)
        output = self._unalias(output)
        if not self.pinned:
            grad = torch.is_grad_enabled()
            for b in range(self.plan.num_buckets):
                if not grad or (b not in self._kept and self.reshard_after_forward and b != self._keep()):
                    self.buckets.free(b)
        return output

    def abort_forward(self) -> None:
        """A forward raised: the modules get their stand-ins back, and every bucket is freed."""
        self.session, self._implicit_owner, self._running = None, None, []
        if not self.pinned:
            self.swap_all(working=False)
            self.buckets.free_all(quiet=True)  # the error in flight is the one to report

    def pin(self) -> None:
        """Every bucket is gathered (the caller waited for them) until :meth:`unpin`: the hooks
        leave them be, and a read of a stand-in computes with its working parameter."""
        self._pins += 1

    def unpin(self, *, quiet: bool = False) -> None:
        """The end of a ``gathered()`` block: every bucket freed, each buffer left to whoever still
        holds a view of it (a ``.numpy()`` array, a ``detach()``, autograd's saved tensors) and the
        next gather filling a new one, so nothing taken inside reads freed memory."""
        self._pins -= 1
        if self._pins == 0:
            self.buckets.free_all(quiet=quiet, renew=True)

    def bucket_done(self, b: int) -> None:
        """Bucket ``b``'s gradients are all accumulated: the backward no longer needs it."""
        self._kept.discard(b)
        if not self.pinned:
            self.buckets.free(b)

    # -- forward ----------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args) -> None:
        del args
        if self.session is None and not self.pinned:
            self.on_implicit_forward()
            self.begin_forward(implicit_owner=module)
        self._running.append(module)
        if self.pinned:
            return
        for i in self._specs_of[module]:
            if i not in self._seen:
                self._seen.add(i)
                self._first_use.append(i)
        if self.needs[module]:
            self._gather(self.needs[module], self.order, self._fwd_pos, "forward")
            self._swap(module, working=True)

    def _swap(self, module: nn.Module, *, working: bool) -> None:
        """Hold the working parameters (views into the gathered buckets) on the module while it
        runs, the user's sharded stand-ins otherwise."""
        for m, name, i in self._owned[module]:
            m._parameters[name] = self.buckets.work[i] if working else self._user_params[i]

    def swap_all(self, *, working: bool) -> None:
        for m in self._owned:
            self._swap(m, working=working)

    def _gather(self, needed: tuple[int, ...], order: tuple[int, ...], pos: dict[int, int], phase: str) -> None:
        """Gather ``needed`` (and prefetch the next buckets of ``order``), then wait for ``needed``."""
        for b in needed:
            self.buckets.gather(b, phase)
        last = max(pos[b] for b in needed)
        for b in order[last + 1:last + 1 + self.prefetch]:
            if phase == "forward" or not self.grads.complete[b]:
                self.buckets.gather(b, phase)
        for b in needed:
            self.buckets.wait(b)

    def _post_forward(self, module: nn.Module, args, output):
        del args
        if self._running and self._running[-1] is module:
            self._running.pop()
        if not self.pinned and self.session is not None:
            self._swap(module, working=False)
            self._keep_aliased(output)
            needed = self.needs[module]
            for b in needed:
                self._done[b].add(module)
            if self.reshard_after_forward:
                keep = self._keep() if torch.is_grad_enabled() else None
                for b in needed:
                    if b != keep and b not in self._kept and self._users[b] <= self._done[b]:
                        self.buckets.free(b)
        if torch.is_grad_enabled() and self.needs[module]:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, m=module: self._pre_backward(m), mode="any")
        if self.session == "implicit" and module is self._implicit_owner and module not in self._running:
            return self.end_forward(output, learn=module is self.root)
        return None

    def _keep(self) -> int | None:
        """The bucket kept from the forward for the backward, which starts with it (or None)."""
        return self.order[-1] if self.keep_for_backward else None

    def _buckets_of_storages(self) -> dict[int, int]:
        return {self.buckets.full[b].untyped_storage().data_ptr(): b
                for b in range(self.plan.num_buckets) if self.buckets.state[b] == READY}

    def _keep_aliased(self, output) -> None:
        """A module that returns a parameter, or a view of one, hands the next module memory of a
        gathered bucket: keep that bucket as long as a read outside its module would be."""
        views = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t._is_view()]
        if views:
            where = self._buckets_of_storages()
            self._kept.update(where[t.untyped_storage().data_ptr()] for t in views
                              if t.untyped_storage().data_ptr() in where)

    def _unalias(self, output):
        """The forward's output, any tensor of it in a gathered bucket's memory copied out (the
        bucket is freed now, and a tensor reading freed memory would read garbage, or crash)."""
        leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t._is_view()]
        if not leaves:
            return output
        where = self._buckets_of_storages()
        if not any(t.untyped_storage().data_ptr() in where for t in leaves):
            return output
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t._is_view()
                        and t.untyped_storage().data_ptr() in where else t, output)

    # -- reads outside the owning module ------------------------------------------------------------

    def working(self, i: int) -> torch.nn.Parameter | None:
        """The working parameter of spec ``i`` for a read that reached its stand-in, or None where
        no forward, backward or ``gathered()`` block runs (the stand-in then raises)."""
        b = self.plan.locate(i)[0]
        if self.pinned:
            return self.buckets.work[i]
        if self.session is not None:
            if i not in self._seen:
                self._seen.add(i)
                self._first_use.append(i)
            if not any(b in self.needs[m] for m in self._running):
                self._kept.add(b)  # no module on the stack gathers it again for the backward
            phase = "forward"
        elif self.grads.in_backward and not self.grads.complete[b]:
            phase = "backward"  # read by a custom backward: freed once its gradients are reduced
        else:
            return None
        if self.buckets.state[b] != READY:
            self.buckets.gather(b, phase)
            self.buckets.wait(b)
        return self.buckets.work[i]

    # -- backward ---------------------------------------------------------------------------------

    def _pre_backward(self, module: nn.Module) -> None:
        self.grads.begin_backward()
        if self.pinned:
            return
        needed = tuple(b for b in self.needs[module] if not self.grads.complete[b])
        if needed:
            if self.grads.steps_in_backward:
                # stepping in the backward is for memory: the last bucket's reduction ends (and
                # its step runs) before this module gathers and computes, so its full gradient
                # bucket is not alive beside this module's gathered parameters and gradients
                self.grads.finish_reductions()
            self._gather(needed, self._bwd_order, self._bwd_pos, "backward")
