"""What a ZeRO3 rank holds, counted by the CPU allocator (hybrid.bench._live: every allocation on
every thread), at world sizes 2, 3 and 4, beside torch's DDP and FSDP2 on the same model.

- Between steps a rank holds its parameter slices and Adam's two moments of them, nothing else:
  exactly ``12 * sum(shard_sizes)`` bytes (+ Adam's 4-byte step counter per flat run and the
  one-element stand-ins of each parameter and its gradient), i.e. a ``1/N`` of DDP's parameters
  and state plus under one element of padding per bucket and rank.
- During a step the gathered working set (full parameter buckets and full gradient buckets
  alive at once) stays within :func:`hybrid.core.zero3_memory`'s stated bound.
- The peak of live tensor bytes over a whole step is no higher than FSDP2's (``fully_shard`` per
  layer, as torch recommends), on an MLP whose layers are each a bucket of the default plan; and on
  a stack of small layers when ZeRO3's cap gives a bucket per layer (FSDP2's unit of gathering).
  There the default plan gathers many layers at once (fewer, larger collectives: the step-time
  end of the cap, docs/zero.md) and its peak is above FSDP2's; the test states it, not hides it.
"""

import gc

import pytest
import torch

from tests._procs import forkserver_ranks

WIDTHS = (768, 1024, 512, 768, 384)  # 4 layers of 1.2-3.1 MB: 2 M parameters, a bucket per layer
SMALL = (96,) * 41  # 40 layers of 37 KB: the default plan gathers ~28 at once, FSDP2 one


def _mlp(widths=WIDTHS):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _measure(world, rank, port, out):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=45))
    report = {"mlp": _measure_model(world, rank, WIDTHS, ("ddp", "fsdp2", "zero3")),
              "small": _measure_model(world, rank, SMALL, ("fsdp2", "zero3", "zero3_layer"))}
    out.put((rank, report, 0.0))
    dist.destroy_process_group()


def _measure_model(world, rank, widths, variants):

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybrid.bench import _live
    from hybrid.core import zero3_memory
    from hybrid.torch import ZeRO3, ZeRO3Optimizer

    _live.install()
    torch.set_num_threads(1)
    x = torch.randn(32, widths[0], generator=torch.Generator().manual_seed(rank))
    report = {}
    for name in variants:
        gc.collect()
        base = _live.live_bytes()
        model = _mlp(widths)
        if name == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        elif name == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))  # named: on a machine with a GPU the default is CUDA
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            net = fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        else:  # a bucket closes on a layer's weight (the plan runs backwards): that cap, a layer a bucket
            layer = widths[0] * widths[1] * 4 / 2**20
            net = ZeRO3(model, bucket_cap_mb=layer if name == "zero3_layer" else None)
            opt = ZeRO3Optimizer(net, torch.optim.Adam, lr=1e-3)
        del model
        peaks = []
        for step in range(3):
            held = _live.live_bytes() - base
            _live.reset_peak()
            if name == "zero3":
                net.reset_peak_memory_stats()
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            peaks.append(_live.peak_bytes() - base)
        report[name] = {"held": held, "peak": max(peaks[1:])}  # after the first step: state exists
        if name.startswith("zero3"):
            stats = net.memory_stats()
            bound = zero3_memory(net.shards, 8, prefetch=net.prefetch).gathered_bytes
            report[name].update(padded=sum(net.shards.shard_sizes), runs=len(opt._segments),
                                working=stats["working_set"], bound=bound,
                                buckets=net.bucket_plan.num_buckets)
        del net, opt
    return report


@pytest.fixture(scope="module")
def live_counter():
    from hybrid.bench import _live
    try:
        _live._build()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no C++ compiler to build the allocator counter: {e}")


@pytest.mark.timeout(170)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_memory_per_rank(live_counter, world):
    reports, _ = forkserver_ranks(_measure, (world,), world, world=world, wait_s=150)
    numel = sum(p.numel() for p in _mlp().parameters())
    for rank, (both, _) in sorted(reports.items()):
        r, small = both["mlp"], both["small"]
        z, ddp, fsdp = r["zero3"], r["ddp"], r["fsdp2"]
        print(f"world {world} rank {rank}: held DDP {ddp['held']} FSDP2 {fsdp['held']} ZeRO3 {z['held']}; "
              f"peak DDP {ddp['peak']} FSDP2 {fsdp['peak']} ZeRO3 {z['peak']}; ZeRO3 working set {z['working']} "
              f"<= {z['bound']} over {z['buckets']} buckets")
        # Parameters and Adam's moments, float32: 1/N of DDP's 12 bytes per parameter, plus padding;
        # Adam's step counter per flat run, and one element for each of the 8 parameters' stand-in
        # and its gradient's.
        assert z["held"] == 12 * z["padded"] + 4 * z["runs"] + 2 * 4 * 8, z
        assert 12 * z["padded"] < 12 * (numel / world + z["buckets"]), (z, numel)
        assert ddp["held"] >= 12 * numel  # DDP: parameters and state (and its gradient buckets)
        assert z["working"] <= z["bound"], z
        assert z["peak"] <= fsdp["peak"], (z, fsdp)
        # 40 small layers: a bucket per layer peaks no higher than FSDP2 per layer; the default plan's
        # buckets of many layers hold more at once (its working set, within its bound) and peak higher.
        fsdp, layer, default = small["fsdp2"], small["zero3_layer"], small["zero3"]
        print(f"world {world} rank {rank}, {len(SMALL) - 1} small layers: peak FSDP2 {fsdp['peak']}, ZeRO3 a layer "
              f"a bucket {layer['peak']} ({layer['buckets']} buckets), default plan {default['peak']} "
              f"({default['buckets']} buckets, working set {default['working']})")
        assert layer["buckets"] == len(SMALL) - 1 and default["buckets"] < layer["buckets"]
        for z in (layer, default):  # slices and moments, Adam's counters, 80 stand-ins and their gradients
            assert z["held"] == 12 * z["padded"] + 4 * z["runs"] + 2 * 4 * 2 * (len(SMALL) - 1), z
        assert layer["peak"] <= fsdp["peak"], (layer, fsdp)
        assert layer["working"] <= layer["bound"] and default["working"] <= default["bound"], small
        assert default["peak"] > fsdp["peak"]  # the price of fewer collectives, stated (docs/zero.md)
