"""Unused parameters in the reducer of hybrid's DDP: which parameters a backward leaves without a
gradient, and which of those no rank used (torch's reducer's unused parameters and its
locally-used map).

With ``find_unused_parameters`` (no ``static_graph``) a synchronizing forward's outputs tell which
parameters the backward cannot reach: the reducer marks them ready itself. A hook that fires with
``.grad`` None (behind an output the loss left out, through torch's sink) counts as unused too,
and a gradient accumulated under ``no_sync()`` counts as used until the synchronizing backward.
Once every bucket is launched, the map of locally used parameters is all-reduced, and a parameter
no rank used keeps its ``.grad`` as it was. With ``static_graph`` the first iteration finds them
(no hook fired) and they stay the same.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hybrid.torch._collectives import naming


def _find_tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # torch's _find_tensors too
        return [t for f in dataclasses.fields(obj) for t in _find_tensors(getattr(obj, f.name))]
    return []


def _reachable_params(outputs) -> set[int]:
    """ids of leaf tensors whose AccumulateGrad node is reachable from ``outputs``' graph.

    >>> w = torch.ones(2, requires_grad=True)
    >>> _reachable_params({"loss": (w * 2).sum(), "text": "no tensor"}) == {id(w)}
    True
    """
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


class UnusedParams:
    """The unused-parameter bookkeeping of one reducer over ``num_params`` parameters.

    Owns ``pending`` (the parameters unused in this iteration, which the reducer marks ready
    itself), ``undefined`` (those whose hook fired with ``.grad`` None in this iteration),
    ``used_in_window`` (those that got a gradient under ``no_sync()`` since the last reduction),
    ``static_unused`` / ``static_globally_unused`` (``static_graph``'s, found in its first
    iteration), the locally-used map and its all-reduce over ``ranks`` (a
    :class:`~hybrid.torch.ddp._sync.RankAgreement`), and whether the unused set ever changed
    (``can_set_static_graph``, logged into ``logger``).
    """

    def __init__(self, num_params: int, ranks, logger):
        self._n, self._ranks, self._logger = num_params, ranks, logger
        self.pending: tuple[int, ...] = ()
        self.undefined: set[int] = set()
        self.used_in_window: set[int] = set()
        self.static_unused: tuple[int, ...] | None = None
        self.static_globally_unused: set[int] | None = None
        self._local_used: torch.Tensor | None = None
        self._work = None
        self._graph_static, self._prev = True, None

    def begin(self, outputs, params: list[torch.Tensor], *, find_unused_parameters: bool, static_graph: bool,
              iteration: int) -> None:
        """At the end of a synchronizing forward: the parameters its ``outputs`` cannot reach
        (``find_unused_parameters``), or ``static_graph``'s."""
        self.pending = ()
        self.undefined = set()
        if find_unused_parameters and not static_graph:
            reach = _reachable_params(outputs)
            self.pending = tuple(i for i, p in enumerate(params) if id(p) not in reach)
            self._note(self.pending, iteration)
        elif static_graph and self.static_unused is not None:
            self.pending = self.static_unused  # found in the first iteration

    def _note(self, unused: tuple[int, ...], iteration: int) -> None:
        """torch logs ``can_set_static_graph`` = 0 (once per process) when the unused parameters
        found first change."""
        if self._graph_static:
            if iteration > 1 and unused != self._prev:
                self._graph_static = False
                self._logger.log_if_graph_static(False, iteration=iteration)
            self._prev = unused

    def share(self, *, all_reduce: bool) -> None:
        """Right after the last bucket launches (torch's order): the locally-used map, all-reduced
        unless ``skip_all_reduce_unused_params`` keeps it local (``all_reduce=False``)."""
        used = torch.ones(self._n, dtype=torch.int32, device=self._ranks.device)
        for i in (*self.pending, *self.undefined):
            if i not in self.used_in_window:
                used[i] = 0
        self._local_used = used
        if all_reduce:
            self._work = dist.all_reduce(used, group=self._ranks.group, async_op=True)

    def record_static(self, unused: tuple[int, ...]) -> None:
        """``static_graph``'s first iteration: ``unused`` (no hook fired) are its unused parameters
        from now on."""
        self.static_unused = self.pending = unused

    def share_static(self) -> None:
        """After ``static_graph``'s first iteration has launched its buckets: the map, all-reduced
        once."""
        if self.static_unused:
            used = torch.ones(self._n, dtype=torch.int32, device=self._ranks.device)
            used[list(self.static_unused)] = 0
            self._local_used = used
            self._work = dist.all_reduce(used, group=self._ranks.group, async_op=True)

    def globally_unused(self, unused, *, static_graph: bool) -> set[int]:
        """Of the locally ``unused`` parameters, those no rank used (waits for the map)."""
        if not unused:
            return set()
        if self.static_globally_unused is not None:
            return self.static_globally_unused
        if self._work is not None:
            with naming("DistributedDataParallel backward: the all-reduce of the used-parameter map"):
                self._work.wait()
        found = {i for i in unused if int(self._local_used[i]) == 0}
        if static_graph:
            self.static_globally_unused = found
        return found

    def end_iteration(self) -> None:
        self.used_in_window.clear()
        self.undefined = set()

    def shadow_share(self) -> None:
        """A joined rank's part in :meth:`share`'s all-reduce: nothing used."""
        dist.all_reduce(torch.zeros(self._n, dtype=torch.int32, device=self._ranks.device), group=self._ranks.group)
