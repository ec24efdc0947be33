"""The foreign formats of ``python -m hybrid bench checkpoint``: torch DCP and orbax, saved and
loaded beside hybrid's own format, on the same model and state, interleaved in one run.

torch (2 gloo ranks, the bench's MLP with Adam, one step taken): a ``hybrid.torch.ZeRO3`` model
and an FSDP2 model (``fully_shard`` per Linear and on the root, CPU mesh) hold the same state,
each fully sharded. Each repetition times, in an order rotated every repetition, after a barrier:

- ``hybrid save``:  ``hybrid.checkpoint.torch.save`` of the ZeRO3 model and its optimizer;
- ``dcp save``:     torch's own ``dcp.save`` of ``get_state_dict(fsdp_model, optimizer)``;
- ``hybrid load``:  ``hybrid.checkpoint.torch.load`` of hybrid's checkpoint into ZeRO3;
- ``load dcp``:     the same load of the DCP checkpoint (hybrid's DCP reader, chunk by chunk);
- ``dcp load``:     torch's own ``dcp.load`` + ``set_state_dict`` of the DCP checkpoint into FSDP2.

JAX (2 host devices, one process): ``hybrid.jax.zero`` stage 2 over Adam beside a plain
``optax.adam`` state, its arrays sharded over the same 2 devices as a flax user's would be, both
after one step (the moments hold data, not zeros that orbax's compression would shrink):

- ``hybrid save``:  ``hybrid.checkpoint.jax.save`` of the zero state;
- ``orbax save``:   orbax's ``StandardCheckpointer.save`` of ``{"params", "opt_state", "step"}``
                    (and ``wait_until_finished``: the save is complete);
- ``hybrid load``:  ``hybrid.checkpoint.jax.load`` of hybrid's checkpoint into the zero state;
- ``load orbax``:   the same load of the orbax checkpoint (orbax's restore, to the host, relaid);
- ``orbax load``:   orbax's ``StandardCheckpointer.restore`` into the sharded tree.

Ratios are each format's time over hybrid's own save or load (lower: the format is faster); the
A/A rows are hybrid's save and load over their previous repetition.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import time
import warnings

from hybrid.cli._table import format_table
from hybrid.bench._stats import NEIGHBOUR_REPS, Ratio, neighbour_reps, ratio_table, rotated

WORLD_SIZE = 2
TORCH_OPS = ("hybrid save", "dcp save", "hybrid load", "load dcp", "dcp load")
JAX_OPS = ("hybrid save", "orbax save", "hybrid load", "load orbax", "orbax load")
# (group, the format's path, hybrid's own path)
TORCH_RATIOS = (("save", "dcp save", "hybrid save"), ("load", "load dcp", "hybrid load"),
                ("load", "dcp load", "hybrid load"))
JAX_RATIOS = (("save", "orbax save", "hybrid save"), ("load", "load orbax", "hybrid load"),
              ("load", "orbax load", "hybrid load"))


def torch_worker(rank: int, port: int, widths, reps: int, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybrid.bench.zero._command import _mlp
    from hybrid.checkpoint import torch as ckpt
    from hybrid.torch import ZeRO3, ZeRO3Optimizer

    torch.set_num_threads(1)
    # Each repetition writes over the last, as a run's saves do; torch warns each time it does.
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    zero3 = ZeRO3(_mlp(widths))
    zero3_opt = ZeRO3Optimizer(zero3, torch.optim.Adam, lr=1e-3)
    torch.manual_seed(0)
    fsdp = _mlp(widths)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))  # named: on a GPU host the default is CUDA
    for layer in fsdp:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
    x = torch.randn(8, widths[0], generator=torch.Generator().manual_seed(rank))
    for net, opt in ((zero3, zero3_opt), (fsdp, fsdp_opt)):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    hybrid_path, dcp_path = pathlib.Path(root) / "hybrid", pathlib.Path(root) / "dcp"

    def dcp_save():
        model_sd, optim_sd = get_state_dict(fsdp, fsdp_opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(dcp_path))

    def dcp_load():
        model_sd, optim_sd = get_state_dict(fsdp, fsdp_opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(dcp_path))
        set_state_dict(fsdp, fsdp_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    ops = {"hybrid save": lambda: ckpt.save(hybrid_path, zero3, zero3_opt, step=1), "dcp save": dcp_save,
           "hybrid load": lambda: ckpt.load(hybrid_path, zero3, zero3_opt),
           "load dcp": lambda: ckpt.load(dcp_path, zero3, zero3_opt), "dcp load": dcp_load}
    ops["hybrid save"]()  # warm-up, and the checkpoints every load reads
    dcp_save()
    dist.barrier()
    times = {op: [] for op in TORCH_OPS}
    for rep in range(reps):
        for op in rotated(TORCH_OPS, rep):
            dist.barrier()
            t = time.perf_counter()
            ops[op]()
            dist.barrier()
            times[op].append(time.perf_counter() - t)
    if rank == 0:
        sizes = {name: sum(f.stat().st_size for f in p.iterdir()) for name, p in (("hybrid", hybrid_path),
                                                                                  ("dcp", dcp_path))}
        pathlib.Path(out).write_text(json.dumps({"times": times, "sizes": sizes,
                                                 "num_params": sum(p.numel() for p in zero3.module.parameters())}))
    dist.destroy_process_group()


def jax_mlp_params(widths) -> dict:
    """The JAX benches' MLP parameters (numpy, seed 0): a weight (out, in) and a zero bias per layer."""
    import numpy as np

    rng = np.random.default_rng(0)
    return {"layers": [{"weight": rng.normal(size=(b, a)).astype(np.float32) * 0.01,
                        "bias": np.zeros(b, np.float32)} for a, b in zip(widths, widths[1:])]}


def jax_bench(widths, reps: int, root: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import hybrid.jax as hj
    from hybrid.checkpoint import jax as ckpt

    params = jax_mlp_params(widths)
    mesh = Mesh(np.array(jax.devices()[:WORLD_SIZE]), ("dp",))
    tx = hj.zero(optax.adam(1e-3), "dp", stage=2)
    specs = hj.state_specs(tx, params, "dp", axis_size=WORLD_SIZE)
    zero_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    # One step (the params as the gradient), so the moments are not zeros that orbax's zstd shrinks.
    half_square = lambda p: sum(0.5 * jnp.sum(x * x) for x in jax.tree_util.tree_leaves(p))
    zero_state = jax.jit(jax.shard_map(lambda s, p: tx.update(hj.local_grad(half_square, "dp")(p), s, p)[1],
                                       mesh=mesh, in_specs=(specs, P()), out_specs=specs))(zero_state, params)

    def shard(x):  # a flax user's placement: split the first dimension where it divides
        split = x.ndim and x.shape[0] % WORLD_SIZE == 0
        return jax.device_put(x, NamedSharding(mesh, P("dp") if split else P()))
    sharded = jax.tree.map(shard, params)
    adam = optax.adam(1e-3)
    tree = {"params": sharded, "opt_state": jax.tree.map(shard, adam.update(sharded, adam.init(sharded), sharded)[1]),
            "step": 1}
    hybrid_path, orbax_path = pathlib.Path(root) / "jax-hybrid", pathlib.Path(root) / "orbax"
    checkpointer = ocp.StandardCheckpointer()

    def orbax_save():
        checkpointer.save(orbax_path, tree, force=True)
        checkpointer.wait_until_finished()

    ops = {"hybrid save": lambda: ckpt.save(hybrid_path, params, zero_state, step=1), "orbax save": orbax_save,
           "hybrid load": lambda: jax.block_until_ready(ckpt.load(hybrid_path, params, zero_state)[:2]),
           "load orbax": lambda: jax.block_until_ready(ckpt.load(orbax_path, params, zero_state)[:2]),
           "orbax load": lambda: jax.block_until_ready(checkpointer.restore(orbax_path, tree))}
    ops["hybrid save"]()
    orbax_save()
    times = {op: [] for op in JAX_OPS}
    for rep in range(reps):
        for op in rotated(JAX_OPS, rep):
            t = time.perf_counter()
            ops[op]()
            times[op].append(time.perf_counter() - t)
    checkpointer.close()  # its threads end with the bench
    sizes = {name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
             for name, p in (("hybrid", hybrid_path), ("orbax", orbax_path))}
    return {"times": times, "sizes": sizes, "num_params": sum(int(np.prod(np.shape(x)))
                                                             for x in jax.tree_util.tree_leaves(params))}


def report(title: str, result: dict, ratios) -> None:
    t = result["times"]
    rows = [[op, f"{statistics.median(v) * 1e3:.1f}", f"{min(v) * 1e3:.1f}..{max(v) * 1e3:.1f}"] for op, v in t.items()]
    sizes = ", ".join(f"{name} {n / 1e6:.1f} MB" for name, n in result["sizes"].items())
    print(f"\n{title}: {result['num_params']:,} parameters + Adam state; files on disk: {sizes}; "
          f"{len(t['hybrid save'])} repetitions")
    print(format_table(["operation", "median ms", "min..max ms"], rows))
    groups = {}
    for group, fmt, own in ratios:
        same = Ratio(f"{own}'", own, *neighbour_reps(t[own])) if len(t[own]) > 1 else None
        groups.setdefault(group, ([], same))[0].append(Ratio(fmt, own, t[fmt], t[own]))
    print(ratio_table(groups, noise=NEIGHBOUR_REPS, group="operation"))


def run(widths, reps: int, root: str, *, skip_jax: bool) -> None:
    """Both parts, printed (the torch part in spawned gloo ranks)."""
    import torch.multiprocessing as mp

    from hybrid.demo._torch_run import free_port

    out = os.path.join(root, "formats.json")
    mp.spawn(torch_worker, args=(free_port(), widths, reps, os.path.join(root, "formats"), out),
             nprocs=WORLD_SIZE, join=True)
    report(f"torch DCP beside hybrid, {WORLD_SIZE} gloo ranks, ZeRO3 and FSDP2", json.loads(pathlib.Path(out).read_text()),
           TORCH_RATIOS)
    if not skip_jax:
        report(f"orbax beside hybrid, JAX on {WORLD_SIZE} host devices, one process",
               jax_bench(widths, reps, root), JAX_RATIOS)
