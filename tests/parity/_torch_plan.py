"""torch's own DistributedDataParallel (the oracle) on the GPT pair's torch half at torch's default
caps, and what it holds after its rebuild: each bucket's parameters and flat buffer as a comm hook
sees them, and the gradients that went in. In the calling process, on a gloo group of 1 rank it
makes and ends (the caller has none of its own)."""

import datetime

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from hybrid.demo._torch_run import free_port
from hybrid.models import GPTConfig, TorchGPT


def torch_buckets(config: GPTConfig, batch: np.ndarray) -> dict:
    """``{"buckets": [(names, flat buffer)], "params": initial weights, "grads": the gradients}``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = TorchGPT(config)
        names = {id(p): n for n, p in model.named_parameters()}
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # torch's defaults: 25 MiB, 1 MiB first
        seen = {}

        def hook(state, bucket):
            # with a hook registered, DDP leaves the buffer unscaled: it holds the local gradients
            seen[bucket.index()] = ([names[id(p)] for p in bucket.parameters()], bucket.buffer().numpy().copy())
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, hook)
        idx = torch.from_numpy(batch)
        for _ in range(2):  # the first iteration observes the ready order, the second runs the rebuilt buckets
            seen.clear()
            model.zero_grad(set_to_none=True)
            ddp(idx, idx)[1].backward()
        buckets = [seen[b] for b in sorted(seen)]
        params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        return {"buckets": buckets, "params": params, "grads": grads}
    finally:
        dist.destroy_process_group()
