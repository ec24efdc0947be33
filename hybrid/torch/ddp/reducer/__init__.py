"""The reducer of hybrid's DDP, as torch's DDP holds its C++ ``Reducer``: the parts that move
gradients into buckets and reduce them.

- ``_buckets.BucketBuffers``: one bucket plan's flat buffers and each gradient's view into them;
  the copies between gradients and buckets (on CUDA through :mod:`hybrid.kernels`).
"""
