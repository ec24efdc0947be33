"""The Join hook of hybrid's DDP: a rank that ran out of inputs shadows the others' collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist
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
        ddp._maybe_rebuild()
        if ddp._check_sync_bufs_pre_fwd():  # torch's: a POST_FORWARD buffer hook is not shadowed
            ddp._sync_buffers(rank_cond=False)
        should_sync = ddp._ranks.backward_sync_flag(False, joined=True)
        ddp.require_forward_param_sync = should_sync
        if not should_sync:
            return
        buckets = range(ddp.bucket_plan.num_buckets)
        if ddp.skip_all_reduce_unused_params:
            # The ranks still training skip each bucket whose parameters all went unused: the same
            # ones on every rank (the flag's promise), so this rank's last iteration names them.
            unused = set(ddp._pending_unused)
            buckets = [b for b in buckets if not unused.issuperset(ddp.bucket_plan.buckets[b].members)]
        if ddp._comm_hook is None:
            works = [dist.all_reduce(ddp._buckets.zero_bucket(b), group=ddp.process_group, async_op=True)
                     for b in buckets]
        else:
            # torch's _match_all_reduce_for_bwd_pass: the hook runs on zero buckets, so that a
            # hook whose collectives are not one all-reduce of the bucket (fp16 compression,
            # PowerSGD, ZeRO2's reduce-scatter) is matched collective for collective.
            works = [ddp._run_comm_hook(b, ddp._buckets.zero_bucket(b)) for b in buckets]
        for w in works:
            w.wait()
        if ddp.find_unused_parameters and not ddp.static_graph and not ddp.skip_all_reduce_unused_params:
            dist.all_reduce(torch.zeros(len(ddp._params), dtype=torch.int32, device=ddp.device),
                            group=ddp.process_group)

    def post_hook(self, is_last_joiner: bool):
        # torch's _sync_final_model: the last rank to join holds the final model.
        ddp = self.ddp
        src = ddp._ranks.find_common_rank(is_last_joiner)
        ddp._sync_module_states(src)
