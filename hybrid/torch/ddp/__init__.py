"""The drop-in DistributedDataParallel: torch's constructor, methods and hook protocol, over a
reducer whose buckets are hybrid.core plans.

``_ddp.DistributedDataParallel`` is a shell (an ``nn.Module`` and torch's ``Joinable``): it keeps
torch's attributes (``module``, ``process_group``, ``static_graph``, ``logger``, ...), what it
reduces (``_names``, ``_params``, ``_index_of``) and the layout settings ranks agree on, and holds
its parts as objects, each owning its fields; its methods delegate to them:

- ``_ranks``: ``_sync.RankAgreement``: the group, its size, this rank, the device; every
  collective by which ranks agree (the model, rank 0's ready order, the plans' fingerprints,
  broadcasts of parameters and buffers, Join's flags).
- ``_reducer``: ``reducer.Reducer``, torch's C++ ``Reducer``: gradient hooks, buckets launched in
  order, the end of the backward, the comm hook; over its own parts: ``BucketBuffers`` (the plan,
  buffers, views, copies), ``BucketRebuild`` (the ready order, the one rebuild, ``"auto"``),
  ``UnusedParams`` (unused parameters, the locally-used map), ``SparseBuckets`` (sparse gradients).
- ``logger``: ``_logging.DDPLogger``, torch's logging data; made with the reducer, which feeds it.
- ``_buffer_sync``: ``_buffers.BufferSync``: the module's buffers, the buffer comm hook, the sync.
- ``_mixed``: ``_mixed.MixedPrecision`` (or None): casts, the reduce dtype, its upcasting hook.
- ``_delayed``: ``_delay.DelayedAllReduce`` (or None): ``delay_all_reduce_named_params``.

Pickling is the shell's (``_pickle``): the process group, ``_ranks``, ``_reducer`` and ``logger``
are made anew on load. Beside them: ``_args`` (the constructor's arguments resolved), ``_hooks`` (torch's
built-in hooks, the fused optimizer), ``_join`` (the Join hook), ``_sink`` (torch's ``_DDPSink``),
``_forward`` (the seam ``hybrid.torch.dynamo`` plugs into), ``_auto`` (``bucket_cap_mb="auto"``),
``_parts`` (which parameters DDP reduces, their specs, the comm hook's ``GradBucket``).
"""

from hybrid.torch.ddp._ddp import DistributedDataParallel
from hybrid.torch.ddp._parts import GradBucket, specs

__all__ = ["DistributedDataParallel", "GradBucket", "specs"]
