"""Pickling hybrid's DDP as torch pickles its own: the module and the settings travel; the process
group, the parts that hold it (rank agreement, reducer) and the logger are made anew on load,
against the default group (torch's rule: only a DDP over the default group pickles)."""

from __future__ import annotations

import torch.distributed as dist

from hybrid.torch.ddp._sync import RankAgreement, is_default_group

# Not pickled (torch drops its process group, reducer and logger too): made anew on load against
# the default group. _index_of holds the parameters' ids, which a copy does not share.
MADE_ON_LOAD = frozenset({"process_group", "_ranks", "_reducer", "logger", "_index_of"})


def pickled_state(ddp) -> dict:
    """What ``ddp.__getstate__`` returns; a mixed-precision DDP, or one over another group, refuses
    as torch's does."""
    if ddp._mixed is not None:
        ddp._mixed.refuse_pickling()
    if not is_default_group(ddp.process_group):
        raise ddp._logged(RuntimeError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default process "
            "group. That is, when you have called init_process_group and have not passed "
            "process_group argument to DDP constructor"), python=True)
    return {k: v for k, v in ddp.__dict__.items() if k not in MADE_ON_LOAD}


def restore_pickled(ddp) -> None:
    """After ``nn.Module.__setstate__``: the group, the rank agreement and the reducer made anew."""
    ddp._reducer, ddp.logger = None, None
    ddp.process_group = dist.distributed_c10d._get_default_group()
    ddp._ranks = RankAgreement(ddp.process_group, ddp.device)
    ddp._index_of = {id(p): i for i, p in enumerate(ddp._params)}
    if ddp._delayed is not None:
        ddp._delayed.attach(ddp.process_group)
    if not ddp._delay_all_reduce_all_params:
        ddp._init_reducer()
