"""Pickling hybrid's DDP as torch pickles its own.

``torch.save`` / ``torch.load``, ``pickle`` and ``copy.deepcopy`` keep the wrapped module and the
settings; the process group and the reducer (buckets, per-iteration state, comm hook, the
gradient hooks) are dropped and rebuilt on load against the default process group, as torch's
``__getstate__`` / ``__setstate__`` do: the copy rebuilds its buckets after its first iteration
and, with ``static_graph``, records its first iteration again.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

# What the reducer holds (rebuilt by _init_reducer) and the process group: never pickled.
_DROPPED = frozenset({
    "process_group", "_ranks", "_div_factor", "_inv_div", "_index_of", "_iteration", "_delaying",
    "_comm_hook", "_has_rebuilt", "_last_order", "_expect_hooks", "_state", "_start_state",
    "_static_unused", "_static_globally_unused", "_futures", "_used_work", "_local_used",
    "_pending_unused", "_used_in_window", "_undefined_now", "_buckets", "_sparse", "_installed_futures",
    "logger", "_num_buckets_reduced", "_graph_static", "_prev_unused", "_ready_clock", "_last_ready_s",
    "_auto_report"})


def _uses_default_group(ddp) -> bool:
    try:
        return ddp.process_group is dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):  # no default group any more
        return False


class Pickling:
    """Mixed into :class:`hybrid.torch.DistributedDataParallel`: ``__getstate__`` / ``__setstate__``."""

    def __getstate__(self):
        if self._mixed is not None:
            self._mixed.refuse_pickling()
        if not _uses_default_group(self):
            raise self._logged(RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process "
                "group. That is, when you have called init_process_group and have not passed "
                "process_group argument to DDP constructor"), python=True)
        return {k: v for k, v in self.__dict__.items() if k not in _DROPPED}

    def __setstate__(self, state):
        nn.Module.__setstate__(self, state)
        self.process_group = dist.distributed_c10d._get_default_group()
        self._set_ranks()
        if self._delayed is not None:
            self._delayed.attach(self.process_group)
        if not self._delay_all_reduce_all_params:
            self._init_reducer()
