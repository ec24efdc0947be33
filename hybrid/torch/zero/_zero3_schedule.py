"""When ZeRO-3 gathers, prefetches and frees each bucket, driven by module hooks.

A module *needs* the buckets holding its own parameters (``module._parameters``; a tied parameter
is needed by every module that holds it). Its forward pre-hook gathers them (starting the
gathers of the next ``prefetch`` buckets in the forward order before waiting) and puts the
working parameters (views into the gathered buckets) in the module's ``_parameters``; its forward
hook puts the user's sharded stand-ins back, and frees a bucket once every module that needs it
has run in this forward. The backward mirrors it: a hook on the module's outputs fires when
their gradient arrives, just before the module's own backward, and gathers its buckets again
(and prefetches the next ones in the reverse order); a bucket is freed once its gradients are
all accumulated (``_zero3_grads``).

The forward order is :func:`hybrid.core.forward_order` of the parameters' first uses observed in
the latest forward (before any forward: the plan's reverse, which is registration order). Every
rank runs the same forward, so every rank issues the same gathers in the same order.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hybrid.core import BucketPlan, forward_order
from hybrid.torch.zero._zero3_grads import GradReducer
from hybrid.torch.zero._zero3_params import ParamBuckets


class Schedule:
    """The module hooks of a ZeRO3 model and the per-pass state they share."""

    def __init__(self, module: nn.Module, plan: BucketPlan, index_of: dict[int, int], buckets: ParamBuckets,
                 grads: GradReducer, *, prefetch: int, reshard_after_forward: bool):
        self.plan, self.buckets, self.grads = plan, buckets, grads
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.needs: dict[nn.Module, tuple[int, ...]] = {}
        self._specs_of: dict[nn.Module, tuple[int, ...]] = {}
        self._owned: dict[nn.Module, list[tuple[str, int]]] = {}  # (attribute, spec index)
        self._users: list[set[nn.Module]] = [set() for _ in plan.buckets]
        self._user_params: dict[int, nn.Parameter] = {}
        for m in module.modules():
            owned = [(name, index_of[id(p)]) for name, p in m._parameters.items()
                     if p is not None and id(p) in index_of]
            if not owned:
                continue
            for name, i in owned:
                self._user_params[i] = m._parameters[name]
            specs = tuple(i for _, i in owned)
            bs = tuple(sorted({plan.locate(i)[0] for i in specs}))
            self.needs[m], self._specs_of[m], self._owned[m] = bs, specs, owned
            for b in bs:
                self._users[b].add(m)
            m.register_forward_pre_hook(self._pre_forward)
            m.register_forward_hook(self._post_forward)
        self._set_order(forward_order(plan))
        self._first_use: list[int] = []
        self._seen: set[int] = set()
        self._done: list[set[nn.Module]] = [set() for _ in plan.buckets]

    def _set_order(self, order: tuple[int, ...]) -> None:
        self.order = order
        self._fwd_pos = {b: k for k, b in enumerate(order)}
        self._bwd_order = order[::-1]
        self._bwd_pos = {b: k for k, b in enumerate(self._bwd_order)}

    # -- forward ----------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self._first_use, self._seen = [], set()
        self._done = [set() for _ in self.plan.buckets]

    def _pre_forward(self, module: nn.Module, args) -> None:
        del args
        for i in self._specs_of[module]:
            if i not in self._seen:
                self._seen.add(i)
                self._first_use.append(i)
        self._gather(self.needs[module], self.order, self._fwd_pos, "forward")
        self._swap(module, working=True)

    def _swap(self, module: nn.Module, *, working: bool) -> None:
        """Hold the working parameters (views into the gathered buckets) on the module while it
        runs, the user's sharded stand-ins otherwise."""
        params = module._parameters
        for name, i in self._owned[module]:
            params[name] = self.buckets.work[i] if working else self._user_params[i]

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
        self._swap(module, working=False)
        needed = self.needs[module]
        for b in needed:
            self._done[b].add(module)
        if self.reshard_after_forward:
            keep = self.order[-1] if torch.is_grad_enabled() else None  # the backward's first bucket
            for b in needed:
                if b != keep and self._users[b] <= self._done[b]:
                    self.buckets.free(b)
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, m=module: self._pre_backward(m), mode="any")
        return None

    def end_forward(self) -> None:
        """After the root forward: learn the order, free what the backward does not start with."""
        if self._first_use:
            order = forward_order(self.plan, first_use=self._first_use)
            if order != self.order:
                self._set_order(order)
        grad = torch.is_grad_enabled()
        for b in range(self.plan.num_buckets):
            if not grad or (self.reshard_after_forward and b != self.order[-1]):
                self.buckets.free(b)

    # -- backward ---------------------------------------------------------------------------------

    def _pre_backward(self, module: nn.Module) -> None:
        self.grads.begin_backward()
        needed = tuple(b for b in self.needs[module] if not self.grads.complete[b])
        if needed:
            self._gather(needed, self._bwd_order, self._bwd_pos, "backward")
