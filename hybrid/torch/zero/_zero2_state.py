"""ZeRO2's optimizer state as whole per-parameter tensors: ``state_dict``, loading, re-slicing.

The state lives in flat slices (one per run of a parameter group in this rank's slice of each
bucket); torch's format, and a new bucket layout after DDP rebuilds its buckets, need whole
per-parameter tensors, built here by all-gathering the slices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybrid.core import BucketPlan, FlatShardPlan
from hybrid.torch._collectives import all_gather_into

# torch 2.13 renamed the flat collectives (the old names warn); older torch has only the old ones.


def _take(shards: FlatShardPlan, b: int, rank: int, full: dict[int, torch.Tensor], *,
          dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s slice of bucket ``b`` built from whole per-tensor values (zeros in padding)."""
    out = torch.zeros(shards.shard_sizes[b], dtype=dtype, device=next(iter(full.values())).device)
    for s in shards.member_slices(b, rank):
        if s.tensor in full:  # tensors without this state (another group's) leave zeros
            out[s.shard_offset:s.shard_offset + s.stop - s.start] = full[s.tensor].reshape(-1)[s.start:s.stop]
    return out


class ShardedState:
    """The state-dict half of :class:`hybrid.torch.ZeRO2` and :class:`hybrid.torch.ZeRO3Optimizer`
    (they supply the layout attributes)."""

    def _relayout(self, plan: BucketPlan) -> None:
        """Move master weights and optimizer state to ``plan``'s slices (DDP rebuilt its buckets).

        Every rank holds the full parameters after each step, so the new master segments are cut
        locally; the state goes through whole per-parameter tensors and is re-cut.
        """
        per_param = self._state_per_param()
        self._set_param_plan(plan)
        for g, group in enumerate(self.optim.param_groups):
            group["params"] = self._masters_of(g)
        self._load_state(per_param)

    def _state_per_param(self) -> dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        """``{DDP index: (sliced state as whole tensors, scalar state)}``. A collective.

        Slices of each state tensor are all-gathered bucket by bucket. Which keys exist, and the
        scalar state (Adam's ``step``), are agreed per group over the ranks first: a rank may hold
        no element of a small group.
        """
        local: dict[int, tuple[dict[str, Any], dict[str, str]]] = {}
        for seg, master in zip(self._segments, self._masters):
            scalars, sliced = local.setdefault(seg.group, ({}, {}))
            for k, v in self.optim.state.get(master, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == master.shape and v.dim() == 1:
                    sliced[k] = str(v.dtype).removeprefix("torch.")
                else:
                    scalars[k] = v
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, local, group=self.process_group)
        scalars_of: dict[int, dict[str, Any]] = {}
        sliced_of: dict[int, dict[str, str]] = {}
        for theirs in everyone:
            for g, (scalars, sliced) in theirs.items():
                for k, v in scalars.items():
                    scalars_of.setdefault(g, {}).setdefault(k, v)
                sliced_of.setdefault(g, {}).update(sliced)
        out: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {
            i: ({}, dict(scalars_of.get(g, {}))) for i, g in enumerate(self._group_of)}
        dtypes = {k: d for sliced in sliced_of.values() for k, d in sliced.items()}
        device = self._params[0].device
        for key in sorted(dtypes):
            slices = [torch.zeros(n, dtype=getattr(torch, dtypes[key]), device=device)
                      for n in self._shards.shard_sizes]
            for seg, master in zip(self._segments, self._masters):
                value = self.optim.state.get(master, {}).get(key)
                if isinstance(value, torch.Tensor):
                    slices[seg.bucket][seg.lo:seg.hi] = value
            for i, t in self._gather_per_tensor(self._plan, self._shards, slices).items():
                if key in sliced_of.get(self._group_of[i], {}):
                    out[i][0][key] = t.view(self._params[i].shape).clone()
        return out

    def _load_state(self, per_param: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]) -> None:
        """Set every master segment's state from whole per-parameter values (no communication)."""
        keys_of: dict[int, set[str]] = {}
        scalars_of: dict[int, dict[str, Any]] = {}
        full_of: dict[str, dict[int, torch.Tensor]] = {}  # key -> {DDP index: whole value}
        for i, (sliced, scalars) in per_param.items():
            keys_of.setdefault(self._group_of[i], set()).update(sliced)
            scalars_of.setdefault(self._group_of[i], {}).update(scalars)
            for key, value in sliced.items():
                full_of.setdefault(key, {})[i] = value
        slices: dict[tuple[int, str], torch.Tensor] = {}
        self.optim.state.clear()
        for seg, master in zip(self._segments, self._masters):
            st: dict[str, Any] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                  for k, v in scalars_of.get(seg.group, {}).items()}
            for key in sorted(keys_of.get(seg.group, ())):
                if (seg.bucket, key) not in slices:
                    slices[seg.bucket, key] = _take(self._shards, seg.bucket, self.rank, full_of[key],
                                                    dtype=torch.float32)
                st[key] = slices[seg.bucket, key][seg.lo:seg.hi].clone()
            if st:
                self.optim.state[master] = st

    def _gather_per_tensor(self, plan: BucketPlan, shards: FlatShardPlan,
                           slices: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """``{tensor index: whole flat value}`` from every rank's slice of every bucket."""
        out = {}
        for b, piece in enumerate(slices):
            full = torch.empty(shards.padded_length(b), dtype=piece.dtype, device=piece.device)
            all_gather_into(full, piece.contiguous(), group=self.process_group)
            bucket = plan.buckets[b]
            for m, o, n in zip(bucket.members, bucket.offsets, bucket.numels):
                out[m] = full[o:o + n]
        return out

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's per-parameter format, as the plain optimizer over the same
        parameter groups would return it (indices numbered group by group, as torch does; with no
        groups given, DDP's parameter order). A collective: call it on every rank.
        """
        per_param = self._state_per_param()
        state = {}
        for pos, i in enumerate(self._torch_order):
            sliced, scalars = per_param[i]
            st = {**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}, **sliced}
            if st:
                state[pos] = st
        groups, pos = [], 0
        for g, group in enumerate(self.optim.param_groups):
            size = self._group_of.count(g)
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(pos, pos + size))})
            pos += size
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's per-parameter format (e.g. a plain optimizer's ``state_dict()`` over the
        same groups); each rank keeps its slices. Tensors shaped like their parameter are sliced;
        others (``step``) copied.
        """
        groups = state_dict["param_groups"]
        sizes = [self._group_of.count(g) for g in range(len(self.optim.param_groups))]
        if [len(g["params"]) for g in groups] != sizes:
            raise ValueError(f"ZeRO2.load_state_dict: the state dict has groups of {[len(g['params']) for g in groups]} "
                             f"parameters, this optimizer {sizes}")
        index_of = {saved: self._torch_order[pos] for pos, saved in
                    enumerate(i for g in groups for i in g["params"])}
        per_param: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {i: ({}, {}) for i in self._torch_order}
        for saved, st in state_dict["state"].items():
            i = index_of[int(saved)]
            for key, value in st.items():
                if isinstance(value, torch.Tensor) and key != "step" and value.shape == self._params[i].shape:
                    per_param[i][0][key] = value.detach().reshape(-1).float()
                else:
                    per_param[i][1][key] = value
        self._load_state(per_param)
        for group, saved in zip(self.optim.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
