"""The Join hook of hybrid's DDP: a rank that ran out of inputs shadows the others' collectives."""

from __future__ import annotations

from torch.distributed.algorithms.join import JoinHook


class _JoinHook(JoinHook):
    """Shadows a still-training rank's collectives from a rank that ran out of data."""

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        ddp.logger.set_uneven_input_join()

    def main_hook(self):
        # Same collectives, same order, as one forward + backward of a rank that still steps.
        ddp = self.ddp
        ddp._reducer.maybe_rebuild()
        # torch's: a POST_FORWARD buffer hook is not shadowed
        if ddp.will_sync_module_buffers() and ddp._buffer_sync.syncs_before_forward():
            ddp._sync_buffers(rank_cond=False)
        should_sync = ddp._ranks.backward_sync_flag(False, joined=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp._reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool):
        # torch's _sync_final_model: the last rank to join holds the final model.
        ddp = self.ddp
        src = ddp._ranks.find_common_rank(is_last_joiner)
        ddp._sync_module_states(src)
