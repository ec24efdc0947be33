"""Ranks of the cost-model test: measure the collectives and time the bench models' step
communication in the same loop, round after round, so both see the same load; then say what the
model fitted from the rounds predicts for each step."""

import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hybrid.core import TensorSpec, plan_buckets, rebuild_plan
from hybrid.core.cost import CostModel, PROBE_SIZES, stream_ends
from hybrid.torch._cost_probe import Prober


def bench_models() -> dict[str, list[TensorSpec]]:
    """The models of python -m hybrid bench ddp / zero, as specs in registration order."""
    def mlp(widths):
        return [s for i, (a, b) in enumerate(zip(widths, widths[1:]))
                for s in (TensorSpec(f"{i}.weight", (b, a), "float32"), TensorSpec(f"{i}.bias", (b,), "float32"))]
    return {"mlp_21M": mlp([2048] * 6), "small_x200": mlp([32] * 101), "zero_mlp": mlp([1536, 2048, 1024, 1536, 768])}


def ddp_plan(specs, size_limits=None):
    """The plan DDP holds after its rebuild: buckets from the ready order (last layer first, a
    bias before its weight), at torch's default caps unless ``size_limits``."""
    plan = plan_buckets(specs, size_limits=[sys.maxsize])
    return rebuild_plan(plan, list(reversed(range(len(specs)))), size_limits=size_limits)


def steps(world: int) -> dict:
    """name -> (buffers to all-reduce, buffers to broadcast after them): each step's collectives
    as hybrid issues them on gloo. DDP: one all-reduce per bucket, back to back; ZeRO-2 on gloo
    (hybrid.torch.ZeRO2): the same all-reduces, then every rank broadcasts its slice of every
    bucket; "per tensor": every gradient its own bucket (what an auto plan can choose)."""
    out = {}
    for name, specs in bench_models().items():
        for variant, plan in (("ddp", ddp_plan(specs)), ("ddp per tensor", ddp_plan(specs, [1]))):
            out[f"{name} {variant}"] = ([b.length * 4 for b in plan.buckets], [])
    plan = ddp_plan(bench_models()["zero_mlp"])
    shards = [-(-b.length // world) * 4 for b in plan.buckets]
    out["zero_mlp zero2"] = ([b.length * 4 for b in plan.buckets], [n for n in shards for _ in range(world)])
    return out


def predict(model: CostModel, reduce: list[int], broadcast: list[int]) -> float:
    """The model's time of the step's collectives: a train of all-reduces, then, once they are
    done, a train of broadcasts (stream_ends with each collective's gaps)."""
    def train(kind, sizes, ready):
        return stream_ends([(ready, model.seconds(kind, n), *model.train_gaps(kind, n)) for n in sizes])[-1]
    end = train("all_reduce", reduce, 0.0)
    return train("broadcast", broadcast, end) if broadcast else end


def step_repeats(reduce_bytes, broadcast_bytes) -> int:
    """Every step is timed at least 3 times a round, short ones up to 8, as the probe times small
    collectives (one sample a round of the 200-all-reduce train, or two of a single 412 KiB
    all-reduce, scattered 2-13x between rounds)."""
    total, count = sum(reduce_bytes) + sum(broadcast_bytes), len(reduce_bytes) + len(broadcast_bytes)
    return max(3, min(8, (4 << 20) // total, 16 // count))


def _time_step(reduce_bufs, broadcast_bufs, world) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.all_reduce(b, async_op=True) for b in reduce_bufs]
    for w in works:
        w.wait()
    works = [dist.broadcast(b, src=i % world, async_op=True) for i, b in enumerate(broadcast_bufs)]
    for w in works:
        w.wait()
    return time.perf_counter() - t0


def measure_and_compare(world, rounds, rank, port, out):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        prober = Prober(None, ("all_reduce", "broadcast"), PROBE_SIZES, torch.device("cpu"))
        work = {name: ([torch.ones(n // 4) for n in red], [torch.ones(n // 4) for n in bc])
                for name, (red, bc) in steps(world).items()}
        reps = {name: step_repeats(*steps(world)[name]) for name in work}
        probe_rounds, measured = [], {name: [] for name in work}  # measured: per round, its times
        for r in range(rounds + 1):  # round 0 warms up (connections, allocations)
            probe = prober.round()
            mine = [_time_step(*work[name], world) for name in work for _ in range(reps[name])]
            slowest = prober.slowest(probe + mine)
            if r:
                probe_rounds.append(slowest[:len(probe)])
                it = iter(slowest[len(probe):])
                for name in work:
                    measured[name].append([next(it) for _ in range(reps[name])])

        def fitted(rounds_):
            return CostModel.fit(**prober.samples(rounds_), world_size=world, about={"backend": "gloo"})

        model = fitted(probe_rounds)
        per_round = [fitted([p]) for p in probe_rounds]
        rows = {name: {"predicted": predict(model, *steps(world)[name]),
                       "measured": statistics.median(t for ts in measured[name] for t in ts),
                       # each round's model against the same round's steps: the load of the moment cancels
                       "rounds": [predict(m, *steps(world)[name]) / statistics.median(ts)
                                  for m, ts in zip(per_round, measured[name])]}
                for name in work}
        out.put((rank, {"rows": rows, "model": model.to_json()}, 0.0))
        dist.destroy_process_group()
    except BaseException as e:  # report instead of hanging the test
        out.put((rank, repr(e), 0.0))
