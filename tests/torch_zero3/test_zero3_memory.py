"""What a ZeRO3 rank holds, counted by the CPU allocator (hybrid.bench._live: every allocation on
every thread), at world sizes 2, 3 and 4, beside torch's DDP and FSDP2 on the same model.

- Between steps a rank holds its parameter slices and Adam's two moments of them, nothing else:
  exactly ``12 * sum(shard_sizes)`` bytes (+ Adam's 4-byte step counter per flat run and the
  one-element stand-ins of each parameter and its gradient), i.e. a ``1/N`` of DDP's parameters
  and state plus under one element of padding per bucket and rank.
- During a step the gathered working set (full parameter buckets and full gradient buckets
  alive at once) stays within :func:`hybrid.core.zero3_memory`'s stated bound.
- ``ZeRO3Optimizer(step_in_backward=True)`` holds the same between steps, its backward leaves no
  gradient slice behind (the default's leaves this rank's float32 share), and its peak is no
  higher. With ``offload_dir`` too, Adam's moments live in files: a rank holds its parameter slices
  alone, and peaks that much lower.
- The peak of live tensor bytes over a whole step is no higher than FSDP2's (``fully_shard`` per
  layer, as torch recommends), on an MLP whose layers are each a bucket of the default plan; and on
  25 Linear(32, 32) with ``policy="memory"`` (a bucket per module, FSDP2's unit of gathering,
  nothing kept between forward and backward). There the default plan gathers many layers at once
  (fewer, larger collectives: the speed-first end, docs/zero3-memory.md) and its peak is above FSDP2's;
  the test states it, not hides it.
"""

import gc
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests._procs import forkserver_ranks

WIDTHS = (768, 1024, 512, 768, 384)  # 4 layers of 1.2-3.1 MB: 2 M parameters, a bucket per layer
# 25 Linear(32, 32) of 4 KB: the default plan gathers all 25 at once, FSDP2 one. The comparisons are
# of one layer gathered at a time against all at once, so the count only scales both sides: at 25
# the default plan still peaks ~100 KB (a third) above FSDP2 and policy="memory" stays under it by
# 1.2-6.4 KB at 2-4 ranks (exact byte counts of the allocator, the same every run); 100 layers
# tripled this file's time for 4x the collectives and nothing more to check.
SMALL = (32,) * 26


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
    report = {"mlp": _measure_model(world, rank, WIDTHS, ("ddp", "fsdp2", "zero3", "zero3_in_backward",
                                                             "zero3_offload")),
              "small": _measure_model(world, rank, SMALL, ("fsdp2", "zero3", "zero3_memory"))}
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
    offload_dir = tempfile.TemporaryDirectory()
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
        else:
            net = ZeRO3(model, policy="memory" if name == "zero3_memory" else "speed")
            opt = ZeRO3Optimizer(net, torch.optim.Adam, lr=1e-3,
                                 step_in_backward=name in ("zero3_in_backward", "zero3_offload"),
                                 offload_dir=offload_dir.name if name == "zero3_offload" else None)
        del model
        peaks, grads = [], []
        for step in range(3):
            held = _live.live_bytes() - base
            _live.reset_peak()
            if name.startswith("zero3"):
                net.reset_peak_memory_stats()
            net(x).pow(2).mean().backward()
            grads.append(_live.live_bytes() - base - held)  # what the backward left for step()
            opt.step()
            opt.zero_grad()
            peaks.append(_live.peak_bytes() - base)
        # after the first step: state exists
        report[name] = {"held": held, "peak": max(peaks[1:]), "after_backward": max(grads[1:])}
        if name.startswith("zero3"):
            stats = net.memory_stats()
            bound = zero3_memory(net.shards, 8, prefetch=net.prefetch).gathered_bytes
            report[name].update(padded=sum(net.shards.shard_sizes), runs=len(opt._segments),
                                offloaded=opt.offloaded_bytes(),
                                working=stats["working_set"], bound=bound,
                                buckets=net.bucket_plan.num_buckets)
        del net, opt
    offload_dir.cleanup()
    return report



WORLDS = (2, 3, 4)


@pytest.fixture(scope="module")
def reports_by_world(live_counter):
    """Every world's reports, the three worlds run at once (9 ranks): each rank counts its own
    process's allocations, so another world's ranks change none of its figures, and a world's ranks
    spend much of a step waiting on each other's collectives, time the other worlds use."""
    with ThreadPoolExecutor(len(WORLDS)) as pool:
        runs = {w: pool.submit(forkserver_ranks, _measure, (w,), w, world=w, wait_s=150) for w in WORLDS}
    return {w: run.result()[0] for w, run in runs.items()}


@pytest.mark.timeout(170)
@pytest.mark.parametrize("world", WORLDS)
def test_memory_per_rank(reports_by_world, world):
    reports = reports_by_world[world]
    numel = sum(p.numel() for p in _mlp().parameters())
    for rank, (both, _) in sorted(reports.items()):
        r, small = both["mlp"], both["small"]
        z, ddp, fsdp = r["zero3"], r["ddp"], r["fsdp2"]
        print(f"world {world} rank {rank}: held DDP {ddp['held']} FSDP2 {fsdp['held']} ZeRO3 {z['held']}; "
              f"peak DDP {ddp['peak']} FSDP2 {fsdp['peak']} ZeRO3 {z['peak']}; ZeRO3 working set {z['working']} "
              f"<= {z['bound']} over {z['buckets']} buckets")
        # Parameters and Adam's moments, float32: 1/N of DDP's 12 bytes per parameter, plus padding;
        # Adam's step counter per flat run (the stand-ins expand one shared zero: 4 bytes, once).
        assert 0 <= z["held"] - (12 * z["padded"] + 4 * z["runs"]) <= 4, z
        assert 12 * z["padded"] < 12 * (numel / world + z["buckets"]), (z, numel)
        assert ddp["held"] >= 12 * numel  # DDP: parameters and state (and its gradient buckets)
        assert z["working"] <= z["bound"], z
        assert z["peak"] <= fsdp["peak"], (z, fsdp)
        # step_in_backward: the same held bytes; the backward leaves no gradient slices for step()
        # (the default's are its float32 share, 4 bytes an element), and the peak is no higher
        zib = r["zero3_in_backward"]
        print(f"world {world} rank {rank}: left by the backward: ZeRO3 {z['after_backward']}, step_in_backward "
              f"{zib['after_backward']}; peak {z['peak']}, step_in_backward {zib['peak']}")
        assert 0 <= zib["held"] - (12 * zib["padded"] + 4 * zib["runs"]) <= 4, zib
        assert 4 * z["padded"] <= z["after_backward"] <= 4 * z["padded"] + 4, z
        assert zib["after_backward"] <= 4, zib  # at most the stand-ins' shared zero
        assert zib["peak"] <= z["peak"], (zib, z)
        # offload_dir: the moments (8 bytes an element) in files, out of the held bytes and the peak
        off = r["zero3_offload"]
        print(f"world {world} rank {rank}: offload_dir: held {off['held']}, in files {off['offloaded']}, peak "
              f"{off['peak']}")
        assert off["offloaded"] == 8 * off["padded"], off
        assert 0 <= off["held"] - (4 * off["padded"] + 4 * off["runs"]) <= 4, off
        assert off["peak"] <= zib["peak"] - 8 * off["padded"] + 4, (off, zib)
        # 25 small layers: the memory policy (a bucket per layer) peaks no higher than FSDP2 per layer;
        # the default plan's buckets of many layers hold more at once (within its bound) and peak higher.
        fsdp, layer, default = small["fsdp2"], small["zero3_memory"], small["zero3"]
        print(f"world {world} rank {rank}, {len(SMALL) - 1} small layers: peak FSDP2 {fsdp['peak']}, ZeRO3 "
              f"policy='memory' {layer['peak']} ({layer['buckets']} buckets), default plan {default['peak']} "
              f"({default['buckets']} buckets, working set {default['working']})")
        assert layer["buckets"] == len(SMALL) - 1 and default["buckets"] < layer["buckets"]
        for z in (layer, default):  # slices and moments, Adam's counters (and at most the shared zero)
            assert 0 <= z["held"] - (12 * z["padded"] + 4 * z["runs"]) <= 4, z
        assert default["working"] <= default["bound"], small
    # Compared on the fullest rank, which bounds what each machine needs: FSDP2 cuts a weight's rows
    # with torch.chunk (11, 11 and 10 of 32 at 3 ranks), so its last rank holds less; flat slices
    # are equal.
    fullest = {name: max(both["small"][name]["peak"] for both, _ in reports.values())
               for name in ("fsdp2", "zero3_memory", "zero3")}
    print(f"world {world}, the fullest rank's peak: {fullest}")
    assert fullest["zero3_memory"] <= fullest["fsdp2"], fullest
    assert fullest["zero3"] > fullest["fsdp2"], fullest  # the price of fewer collectives, stated (docs/zero3-memory.md)
