"""The buckets' one rebuild (torch's ``rebuild_buckets``): the first iteration's gradient-ready
order is recorded, and the next forward replaces the initial one-bucket-per-dtype plan with one
built from rank 0's order (``hybrid.core.rebuild_plan``), or with ``bucket_cap_mb="auto"`` from
the measured cost model (:func:`hybrid.torch.ddp._auto.plan_auto`). Every rank's plan is compared
before use.
"""

from __future__ import annotations

from hybrid.core import BucketPlan, rebuild_plan
from hybrid.core._reducer_state import ReducerState
from hybrid.torch.ddp._auto import ReadyClock, plan_auto


class BucketRebuild:
    """When and into what one reducer's buckets are rebuilt.

    Owns ``has_rebuilt``; ``last_order`` (the ready order the rebuild will use, or None);
    ``clock`` (``bucket_cap_mb="auto"``'s :class:`ReadyClock`, which the gradient hooks read
    until the rebuild; else None), ``last_ready_s`` (its times for the recorded order) and
    ``auto_report`` (what the auto plan was made from); ``collectives`` (what the auto planner
    plans for: DDP's all-reduce unless ZeRO2 states its own). The collectives run over ``ranks``
    (a :class:`~hybrid.torch.ddp._sync.RankAgreement`); ``layout_settings`` are named in the error
    when ranks rebuild differently.
    """

    def __init__(self, num_params: int, ranks, layout_settings: dict, *, auto: bool, rebuild_limits,
                 in_place: bool):
        self._ranks, self._layout_settings = ranks, layout_settings
        self._auto, self._rebuild_limits, self._in_place = auto, rebuild_limits, in_place
        self.has_rebuilt = False
        self.last_order: tuple[int, ...] | None = None
        self.clock = ReadyClock(num_params, ranks.device) if auto else None
        self.last_ready_s: list[float] | None = None
        self.auto_report: dict | None = None
        self.collectives: tuple = ("all_reduce", ())

    def due(self, *, static_graph: bool, find_unused_parameters: bool) -> bool:
        """Whether the next forward rebuilds: once, from a recorded order, and never with
        find_unused_parameters unless static_graph (torch's rule)."""
        return (not self.has_rebuilt and self.last_order is not None
                and (static_graph or not find_unused_parameters))

    def new_plan(self, plan: BucketPlan) -> BucketPlan:
        """``plan`` rebuilt from rank 0's recorded order (a collective: every rank calls it)."""
        order = self._ranks.rank0_order(self.last_order)
        if self._auto:
            new, self.auto_report = plan_auto(self._ranks, plan.specs, order, self.last_ready_s,
                                              collectives=self.collectives, in_place=self._in_place)
            self.clock = None  # the times are in; the hooks stop reading the clock
        else:
            new = rebuild_plan(plan, order, size_limits=self._rebuild_limits)
        self._ranks.check_same_plan(new, self._layout_settings)
        self.has_rebuilt = True
        return new

    def record(self, state: ReducerState, *, static_graph: bool) -> None:
        """At the end of a reduced backward: its ready order, the first time. torch's static_graph
        records it in its second iteration (the first one's hooks only count), the unused
        parameters last, by index."""
        if self.last_order is not None:
            return
        self.last_order = state.ready_order if not static_graph else (
            tuple(i for i in state.ready_order if i not in state.unused) + tuple(sorted(state.unused)))
        if self.clock is not None:
            self.last_ready_s = self.clock.times()  # of the iteration whose order it is

    def hint(self, order: tuple[int, ...]) -> None:
        """The order to rebuild from, known before any backward (``hybrid.torch.dynamo``: the
        graph's reverse-use order); ignored once an order is recorded or the rebuild is done."""
        if not self.has_rebuilt and self.last_order is None:
            self.last_order = tuple(order)
