"""The reducer of hybrid's DDP, as torch's DDP holds its C++ ``Reducer``: one object,
:class:`Reducer` (``_reducer``), over parts of its own, each owning its fields:

- ``_buckets.BucketBuffers``: one bucket plan's flat buffers and each gradient's view into them;
  every copy between gradients and buckets (on CUDA through :mod:`hybrid.kernels`).
- ``_rebuild.BucketRebuild``: the recorded gradient-ready order and the buckets' one rebuild
  (``bucket_cap_mb="auto"``: the ready clock, the auto plan and its report).
- ``_unused.UnusedParams``: unused parameters, the locally-used map and its all-reduce.
- ``_sparse.SparseBuckets``: sparse gradients (a bucket each) and torch's sparse metadata.
- ``_messages``: torch's reducer error texts.
"""

from hybrid.torch.ddp.reducer._reducer import Reducer

__all__ = ["Reducer"]
