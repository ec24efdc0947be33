"""Worker processes for the DDP error and fault tests in tests/torch/test_ddp.py: misuse that must
raise torch's error (different models or settings per rank, unused parameters, bad comm hooks,
torch's unfinished-reduction text at each debug level), and a peer that dies or stalls."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _workers import MLP, Unused, _data, _expect, _init
from hybrid.torch import DistributedDataParallel as HybridDDP


def errors_worker(rank, world, port, outdir):
    _init(rank, world, port, timeout_s=int(os.environ.get("HYBRID_TEST_PG_TIMEOUT", "30")))
    res = {}

    # Different models across ranks: parameter count, then a shape.
    res["count"] = _expect(lambda: HybridDDP(MLP(depth=3 + (rank == 1))))
    res["shape"] = _expect(lambda: HybridDDP(MLP(width=32 + (rank == 1))))

    # A parameter with no gradient, without find_unused_parameters.
    def unused_without_flag():
        torch.manual_seed(0)
        ddp = HybridDDP(Unused())
        for step in range(2):
            x, y = _data(rank, step, "unused")
            ddp(x).sum().backward()
    res["unused"] = _expect(unused_without_flag)
    dist.barrier()

    def static_graph_changed():
        torch.manual_seed(0)
        ddp = HybridDDP(Unused(), static_graph=True)
        x, _ = _data(rank, 0, "unused")
        ddp(x).sum().backward()
        ddp(x, use_extra=True).sum().backward()  # ``sometimes`` was unused in iteration 1
    res["static_changed"] = _expect(static_graph_changed)
    dist.barrier()

    # static_graph the other way round: ``sometimes`` used in iteration 1, unused from then on.
    # torch notices at the forward after the first backward that leaves it out.
    for label, cls in (("torch", TorchDDP), ("hybrid", HybridDDP)):
        torch.manual_seed(0)
        ddp = cls(Unused(), static_graph=True)
        x, _ = _data(rank, 0, "unused")
        done = []

        def used_then_unused():
            for it, extra in enumerate([True, False, False]):
                ddp(x, use_extra=extra).sum().backward()
                done.append(it)
        err = _expect(used_then_unused)
        res[f"static_used_then_unused_{label}"] = (err, len(done))
        dist.barrier()

    ddp = HybridDDP(MLP())
    res["not_callable"] = _expect(lambda: ddp.register_comm_hook(None, 3))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    res["twice"] = _expect(lambda: ddp.register_comm_hook(None, default_hooks.allreduce_hook))

    def no_future():
        d = HybridDDP(MLP())
        d.register_comm_hook(None, lambda state, bucket: bucket.buffer())
        d(_data(rank, 0, "mlp")[0]).sum().backward()
    res["no_future"] = _expect(no_future)
    # A comm hook whose Future holds no tensor: torch raises "Unable to cast ... to Tensor".
    for label, cls in (("torch", TorchDDP), ("hybrid", HybridDDP)):
        for kind, value in (("int", 3), ("dict", {"a": 1})):
            def bad_value(cls=cls, value=value):
                d = cls(MLP())

                def hook(state, bucket):
                    fut = torch.futures.Future()
                    fut.set_result(value)
                    return fut
                d.register_comm_hook(None, hook)
                d(_data(rank, 0, "mlp")[0]).sum().backward()
            res[f"bad_future_{kind}_{label}"] = _expect(bad_value)
            dist.barrier()
    # Per-rank bucket caps that differ: named, with both values, in MB.
    res["cap_differs"] = _expect(lambda: HybridDDP(MLP(), bucket_cap_mb=1 if rank == 0 else 25))
    res["unsupported"] = _expect(lambda: HybridDDP(MLP(), mixed_precision=object()))
    res["unfinished_texts"] = _unfinished_reduction_texts(rank)
    for label, cls in (("torch", TorchDDP), ("hybrid", HybridDDP)):
        res[f"marked_twice_{label}"] = _expect(lambda: _reentrant_checkpoint_twice(cls))
        dist.barrier()
    res["state_dict_keys"] = sorted(HybridDDP(MLP()).state_dict().keys())
    res["torch_state_dict_keys"] = sorted(TorchDDP(MLP()).state_dict().keys())
    torch.save(res, os.path.join(outdir, f"errors_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


class _Checkpointed(nn.Module):
    """``a`` under a reentrant activation checkpoint: its gradient hooks fire in a second,
    nested backward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.b(checkpoint(self.a, x, use_reentrant=True))


def _reentrant_checkpoint_twice(cls):
    """torch's "marked ready twice": with find_unused_parameters, the checkpointed parameters are
    marked unused by the search from the outputs, then their hooks fire in the reentrant backward."""
    torch.manual_seed(0)
    ddp = cls(_Checkpointed(), find_unused_parameters=True)
    ddp(torch.ones(2, 4, requires_grad=True)).sum().backward()


class _TwoHeads(nn.Module):
    """Two outputs of two layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def _unfinished_reduction_texts(rank):
    """torch's and our error texts when a forward starts before the last reduction finished, for
    each debug level (TORCH_DISTRIBUTED_DEBUG, read when the DDP is built) and each of torch's
    three wordings: a parameter never used, a backward that skips parameters reachable from the
    outputs with find_unused_parameters, a static graph that changed."""
    def plain(cls):
        ddp = cls(Unused())
        for step in range(2):
            ddp(_data(rank, step, "unused")[0]).sum().backward()

    def find_unused(cls):
        # Every head is in the loss, but the backward is asked for one weight only: the other
        # parameters are reachable from the outputs yet get no gradient hook at all.
        ddp = cls(_TwoHeads(), find_unused_parameters=True)
        for _ in range(2):
            out = ddp(torch.ones(3, 8))
            (out[0].sum() + out[1].sum()).backward(inputs=[ddp.module.a.weight])

    def static(cls):
        ddp = cls(Unused(), static_graph=True)
        x = _data(rank, 0, "unused")[0]
        for extra in (True, False, False):
            ddp(x, use_extra=extra).sum().backward()

    texts = {}
    for level in ("INFO", "OFF"):
        dist.set_debug_level(getattr(dist.DebugLevel, level))
        try:
            for name, misuse in (("plain", plain), ("find_unused", find_unused), ("static", static)):
                for label, cls in (("torch", TorchDDP), ("hybrid", HybridDDP)):
                    torch.manual_seed(0)
                    texts[level, name, label] = _expect(lambda: misuse(cls))
                    dist.barrier()
        finally:
            dist.set_debug_level(dist.DebugLevel.OFF)
    return texts


def _one_good_iteration(rank, world, port, timeout_s):
    """A DDP over an MLP that has run one synchronized iteration on every rank; its input."""
    _init(rank, world, port, timeout_s=timeout_s)
    ddp = HybridDDP(MLP())
    x, _ = _data(rank, 0, "mlp")
    ddp(x).sum().backward()
    dist.barrier()
    return ddp, x


def dead_peer_worker(rank, world, port, outdir):
    # A long process-group timeout: the survivor must raise because gloo sees the closed
    # connection, not because a short timeout ran out.
    ddp, x = _one_good_iteration(rank, world, port, timeout_s=60)
    if rank == 1:
        os._exit(0)  # a peer dies between iterations
    start = time.monotonic()
    err = _expect(lambda: [ddp(x).sum().backward() for _ in range(3)])
    torch.save({"error": err, "elapsed": time.monotonic() - start},
               os.path.join(outdir, f"dead_rank{rank}.pt"))
    os._exit(0)


def stalled_peer_worker(rank, world, port, outdir):
    # The peer is alive but stops taking part: the survivor's wait ends at the process group's
    # timeout (2 s here), the one the user set.
    ddp, x = _one_good_iteration(rank, world, port, timeout_s=2)
    if rank == 1:
        # Stalls (up to 6 s, 3x the timeout) until the survivor has saved what it raised: never
        # leaving before the survivor's timeout, and never making the test wait out the 6 s.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not os.path.exists(os.path.join(outdir, "stalled_rank0.done")):
            time.sleep(0.05)
        os._exit(0)
    start = time.monotonic()
    err = _expect(lambda: ddp(x).sum().backward())
    torch.save({"error": err, "elapsed": time.monotonic() - start},
               os.path.join(outdir, f"stalled_rank{rank}.pt"))
    open(os.path.join(outdir, f"stalled_rank{rank}.done"), "w").close()
    os._exit(0)
