"""ZeroRedundancyOptimizer's state dicts in torch's global format: consolidating every rank's
local state on one rank, and loading a global state dict (each rank keeps what it owns).

With ``overlap_with_ddp=True`` the state lives in the overlap hook's per-bucket optimizers and is
collected from, and handed to, those.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybrid.torch.zero._parts import _copy_to_device, _sync_param_groups


class ConsolidatedState:
    """The state-dict half of :class:`hybrid.torch.ZeroRedundancyOptimizer` (it supplies the
    partition, the local optimizer and the process group)."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's local optimizer state on rank ``to`` (call it on all ranks).

        With ``overlap_with_ddp=True`` the state lives in the overlap hook's per-bucket
        optimizers; it is collected from there, in the same global format.
        """
        _sync_param_groups(self.param_groups, self.optim.param_groups)
        cpu = torch.device("cpu")
        local = self._overlap_local_state if self._overlap_with_ddp else self.optim.state_dict
        self._all_state_dicts = []
        for rank in range(self.world_size):
            if rank == to:
                if self.rank == to:
                    self._all_state_dicts.append(_copy_to_device(local(), cpu))
                continue
            # Broadcast (not gather) as torch does: NCCL has no object gather that is safe here.
            box = [_copy_to_device(local(), cpu) if rank == self.rank else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.process_group, rank),
                                       group=self.process_group, device=self._default_device)
            if self.rank == to:
                self._all_state_dicts.append(box[0])

    def _global_index(self) -> dict[int, int]:
        """``{id(param): global state-dict index}``."""
        return {id(p): i for i, p in enumerate(self._params)}

    def _overlap_local_state(self) -> dict[str, Any]:
        """This rank's overlap state as ``{"state": {global index: state}}`` (no param groups:
        the hook's optimizers take theirs from this optimizer's one group)."""
        index = self._global_index()
        state = dict(self._overlap_pending_state)  # loaded, not yet handed to the hook
        runtime = getattr(self, "_overlap_runtime", None)
        for opt in (runtime.optims.values() if runtime is not None else ()):
            state.update((index[id(p)], dict(s)) for p, s in opt.state.items())
        return {"state": state}

    def state_dict(self) -> dict[str, Any]:
        """The global state (torch's format, global indices) last consolidated on this rank."""
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. "
                f"Please call `consolidate_state_dict(to={self.rank})` on "
                "all ranks beforehand if you meant to save the global state.")
        state_dict = super().state_dict()
        if self._overlap_with_ddp:
            for local in self._all_state_dicts:
                state_dict["state"].update(local["state"])
            state_dict["state"] = dict(sorted(state_dict["state"].items()))
            return state_dict
        for rank, local in enumerate(self._all_state_dicts):
            owned_per_group = self.partition.per_rank[rank]
            assert len(local["param_groups"]) == len(owned_per_group)
            for local_group, owned in zip(local["param_groups"], owned_per_group):
                assert len(local_group["params"]) == len(owned)
                for local_index, global_index in zip(local_group["params"], owned):
                    if local_index in local["state"]:
                        state_dict["state"][global_index] = local["state"][local_index]
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a global state dict (from hybrid, torch's ZeRO or a plain optimizer).

        This rank keeps only the state of the parameters it owns; ``state_dict`` is not modified.
        """
        params = self._params
        if self._overlap_with_ddp:
            self._load_overlap_state(state_dict["state"])
        owned = set(self.partition.owned(self.rank)) if not self._overlap_with_ddp else set()
        for index, value in state_dict["state"].items():
            if index in owned and value is not None:
                param = params[index]
                local = _copy_to_device(value, param.device)
                # torch keeps zero-dimensional state (Adam's "step") on the CPU.
                self.optim.state[param] = {k: v.cpu() if torch.is_tensor(v) and v.dim() == 0 else v
                                           for k, v in local.items()}
        # The base class checks the groups and takes their hyperparameters; the state itself
        # lives in the local optimizer only, so it gets placeholders (torch stores None too).
        super().load_state_dict({**state_dict, "state": {i: None for i in state_dict["state"]}})
        _sync_param_groups(state_dict["param_groups"], self.param_groups)
        _sync_param_groups(self.param_groups, self.optim.param_groups)

    def _load_overlap_state(self, states: dict[int, Any]) -> None:
        """Hand loaded state to the overlap hook's optimizers (each keeps what its bucket slice
        owns), or keep it for the hook's first plan if it has not assigned buckets yet."""
        params = self._params
        loaded = {}
        for index, value in states.items():
            if value is not None:
                local = _copy_to_device(value, params[index].device)
                # torch keeps zero-dimensional state (Adam's "step") on the CPU.
                loaded[index] = {k: v.cpu() if torch.is_tensor(v) and v.dim() == 0 else v for k, v in local.items()}
        runtime = getattr(self, "_overlap_runtime", None)
        if runtime is None or runtime.plan is None:
            self._overlap_pending_state = loaded
            return
        index = self._global_index()
        for opt in runtime.optims.values():
            opt.state.clear()  # as torch's load_state_dict: state not in the dict is dropped
            for p in opt.param_groups[0]["params"]:
                if index[id(p)] in loaded:
                    opt.state[p] = loaded[index[id(p)]]
        self._overlap_pending_state = {}
