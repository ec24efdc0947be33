"""Every rank says which call it is entering before that call's collectives run, so that a call
made on some ranks only fails at once, on every rank, naming both calls, instead of pairing its
collectives with another call's (a hang until the process group's timeout, or, where the sizes
happen to match, wrong values returned without a word).

The check is one small all-reduce at the start of each collective call of a component (a ZeRO3
forward, its backward, ``state_dict()``, ...): each rank writes its row (the call, how many calls
the component has made, which instance it is) into a zero tensor and the sum gives every rank
every row. It is the first collective of every guarded call, so two ranks in different guarded
calls always meet in it, whatever the calls do next. On gloo it costs about one all-reduce of a
few bytes (~0.1 ms) per call; an all-gather of the same rows takes ten times that there.
"""

from __future__ import annotations

import itertools
import zlib

import torch
import torch.distributed as dist

from hybrid.torch._collectives import naming

_MAGIC = 0x5A3C  # a row of a guard; anything else means the peer ran another collective
_FIELDS = 4  # magic, call code, calls made so far, instance
_instances = itertools.count(1)

# Every guarded call by name, so a rank can name the call another rank is in even if it never made it.
CALLS = ("construction", "forward", "forward (the inner module called directly)", "backward", "gathered()",
         "state_dict()", "full_state_dict()", "ZeRO3Optimizer.clip_grad_norm_()", "ZeRO3Optimizer.state_dict()",
         "hybrid.checkpoint.torch.save")


def _code(call: str) -> int:
    return zlib.crc32(call.encode())


_NAME_OF = {_code(c): c for c in CALLS}

# What to do instead, when one side of a mismatch is a call that users make on one rank by habit.
_FIXES = {
    "state_dict()": "model.state_dict() gathers every parameter from every rank: call it on every rank, then save "
                    "on rank 0 only (sd = model.state_dict(); if rank == 0: torch.save(sd, path)); or "
                    "model.full_state_dict() on every rank, which gives rank 0 the whole dict and the others an "
                    "empty one; or hybrid.checkpoint.torch.save(path, model, opt) on every rank, each writing its "
                    "own slices (no rank holds the whole model)",
    "full_state_dict()": "model.full_state_dict() is a collective: call it on every rank (rank 0 gets the dict)",
    "gathered()": "model.gathered() gathers every parameter from every rank: enter it on every rank",
    "forward (the inner module called directly)":
        "calling model.module(x) runs the same gathers as model(x): call it on every rank (to evaluate on one "
        "rank, gather a full state dict to it first)",
    "ZeRO3Optimizer.state_dict()": "the optimizer's state_dict() gathers its slices from every rank: call it on "
                                   "every rank, save on one",
    "hybrid.checkpoint.torch.save": "hybrid.checkpoint.torch.save is a collective: call it on every rank (each "
                                    "writes its own file)",
}


class CallMismatch(RuntimeError):
    """Ranks entered different collective calls (or the same call a different number of times)."""


class CallGuard:
    """The check at the start of every collective call of one component instance (a ZeRO3 model);
    ``device``: where the backend takes tensors (the CPU for gloo, the model's GPU for NCCL).

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> guard = CallGuard(None, "ZeRO3")
    >>> guard.enter("forward"); guard.calls  # a world of one has nothing to check
    1
    >>> dist.destroy_process_group()
    """

    def __init__(self, group, component: str, device: torch.device | str = "cpu"):
        self.group, self.component, self.device = group, component, torch.device(device)
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.instance = next(_instances)  # the same on every rank that builds its components in one order
        self.calls = 0

    def enter(self, call: str) -> None:
        """Check that every rank is entering ``call`` as its same-numbered call; raise
        :class:`CallMismatch` on every rank otherwise. Call before the call's first collective."""
        assert call in CALLS, call
        self.calls += 1
        if self.world_size == 1:
            return
        rows = torch.zeros(self.world_size, _FIELDS, dtype=torch.int64, device=self.device)
        rows[self.rank] = torch.tensor([_MAGIC, _code(call), self.calls, self.instance], device=self.device)
        with naming(f"{self.component} {call}: the check that every rank entered this call (a rank that never "
                    f"calls it leaves the others waiting here)"):
            dist.all_reduce(rows, group=self.group)
        mine = rows[self.rank].tolist()
        if all(r == mine for r in rows.tolist()):
            return
        raise CallMismatch(self._message(call, rows.tolist()))

    def _message(self, call: str, rows: list[list[int]]) -> str:
        def what(rank: int, row: list[int]) -> str:
            magic, code, count, instance = row
            if magic != _MAGIC:
                return f"rank {rank} is in a collective that is not a {self.component} call"
            name = _NAME_OF.get(code, f"an unknown call (code {code})")
            other = "" if instance == self.instance else f" of another {self.component} instance (#{instance})"
            return f"rank {rank} is in {self.component} {name}{other} (its call {count})"

        seen = [what(r, row) for r, row in enumerate(rows)]
        names = {_NAME_OF.get(row[1]) for row in rows if row[0] == _MAGIC}
        fixes = [_FIXES[n] for n in sorted(names, key=CALLS.index) if n in _FIXES]
        return (f"{self.component} {call}: ranks entered different collective calls: {'; '.join(seen)}. Every rank "
                f"must make {self.component}'s collective calls in the same order; a call made on some ranks only "
                f"would pair its collectives with another call's (a hang, or wrong values)."
                + (" Fix: " + "; ".join(fixes) + "." if fixes else ""))
