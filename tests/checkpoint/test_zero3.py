"""ZeRO3 runs through hybrid checkpoints, without gathering (no collective that moves tensors
runs in a ZeRO3 save or load: the test makes them raise): a stage-3 checkpoint resumes at
another world size and bucket plan in ZeRO3, in stages 2 and 1 and in a plain optimizer, and loads
into optax; a stage-2 checkpoint resumes in ZeRO3.

Every run trains the same MLP on the same global batches (12 rows a step, split evenly over the
ranks), so a resumed run must follow the uninterrupted one: within rtol 1e-6 / atol 1e-7 (another
world size only changes the order of float32 additions in the gradient mean, as in
tests/checkpoint/test_resume.py). Loaded tensors are compared bit for bit with the saved ones
(a load moves elements, it computes nothing).
"""

import contextlib

import numpy as np
import pytest
import torch

from hybrid.checkpoint import Checkpoint
from tests._procs import forkserver_ranks

SAVE, STEPS = 3, 6
SAME = dict(rtol=1e-6, atol=1e-7)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 4))


def _batch(step, rank, world):
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(step))
    return x.chunk(world)[rank]


def _run(kind, path_in, path_out, rank, port, out):
    """Train ``kind`` from ``path_in`` (or from scratch) to STEPS, saving at SAVE into
    ``path_out``; rank 0 reports the final parameters (and what it saved)."""
    import datetime

    import torch.distributed as dist

    from hybrid.checkpoint import torch as ckpt
    from hybrid.torch import DistributedDataParallel, ZeRO2, ZeRO3, ZeRO3Optimizer, ZeroRedundancyOptimizer

    stage, world, cap = kind
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=45))
    model = _model()
    if stage == 3:
        net = ZeRO3(model, bucket_cap_mb=cap)
        opt = ZeRO3Optimizer(net, torch.optim.Adam, lr=0.01)
    elif stage == 2:
        net = DistributedDataParallel(model)
        opt = ZeRO2(net, torch.optim.Adam, lr=0.01)
    else:
        net = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    with _no_tensor_collectives(stage == 3):
        start = 0 if path_in is None else ckpt.load(path_in, net, opt)
    saved = None
    for step in range(start, STEPS):
        if step == SAVE and path_out is not None:
            with _no_tensor_collectives(stage == 3):
                ckpt.save(path_out, net, opt, step=step)
            saved = _state(net, opt)
        net(_batch(step, rank, world)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    final = _state(net, opt)
    out.put((rank, (final, saved), 0.0))


@contextlib.contextmanager
def _no_tensor_collectives(active: bool):
    """ZeRO3's saves and loads gather nothing: every collective that moves tensors raises inside,
    but the few bytes of the check every collective call of ZeRO3 starts with (which call, how
    many: ``hybrid.torch._call_guard``)."""
    import sys

    import torch.distributed as dist

    names = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "broadcast", "reduce",
             "reduce_scatter_tensor", "reduce_scatter_single", "send", "recv", "isend", "irecv")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def refuse(name):
        def fn(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith("_call_guard.py"):
                return saved[name](*args, **kwargs)
            raise AssertionError(f"a ZeRO3 checkpoint moved tensors between ranks: {name}")
        return fn
    if active:
        for n in saved:
            setattr(dist, n, refuse(n))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _state(net, opt):
    """Whole parameters and Adam moments (torch's state-dict indices), as numpy arrays: a
    collective for the ZeRO optimizers. Rank 0's is the one reported."""
    from hybrid.torch import ZeroRedundancyOptimizer

    params = {k.removeprefix("module."): v.detach().numpy().copy() for k, v in net.state_dict().items()}
    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.consolidate_state_dict(to=0)
        if torch.distributed.get_rank() != 0:
            return params, None
    state = opt.state_dict()["state"]
    return params, {i: {k: v.numpy().copy() for k, v in st.items() if k != "step"} for i, st in state.items()}


def _launch(kind, path_in=None, path_out=None):
    reports, _ = forkserver_ranks(_run, (kind, path_in, path_out), kind[1], world=kind[1], wait_s=120)
    return reports[0][0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("zero3")
    out = {"dir": d}
    out["zero3"] = _launch((3, 2, 1e-4), path_out=str(d / "stage3"))  # 3 buckets, 2 ranks
    out["zero3_to_zero3"] = _launch((3, 3, None), path_in=str(d / "stage3"))  # 1 bucket, 3 ranks
    out["zero3_to_zero2"] = _launch((2, 3, None), path_in=str(d / "stage3"))
    out["zero3_to_zero1"] = _launch((1, 2, None), path_in=str(d / "stage3"))
    out["zero2"] = _launch((2, 2, None), path_out=str(d / "stage2"))
    out["zero2_to_zero3"] = _launch((3, 3, 5e-5), path_in=str(d / "stage2"))
    return out


def test_the_save_is_the_slices(runs):
    """The manifest records stage 3 and ZeRO3's own plan; the files hold the parameters and Adam
    moments at the save, bit for bit."""
    ckpt = Checkpoint(runs["dir"] / "stage3")
    assert ckpt.manifest.stage == 3 and ckpt.manifest.world_size == 2 and ckpt.manifest.step == SAVE
    assert ckpt.manifest.plan.num_buckets == 3 and ckpt.manifest.optimizer.count == SAVE  # one per layer
    (params, sd), = [runs["zero3"][1]]
    for name, value in ckpt.tensors("params").items():
        assert np.array_equal(value, params[name]), name
    names = list(ckpt.tensors("params"))
    for slot, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        for name, value in ckpt.tensors(slot).items():
            assert np.array_equal(value, sd[names.index(name)][key]), (slot, name)


@pytest.mark.parametrize("resumed, uninterrupted", [("zero3_to_zero3", "zero3"), ("zero3_to_zero2", "zero3"),
                                                    ("zero3_to_zero1", "zero3"), ("zero2_to_zero3", "zero2")])
def test_resumed_run_follows_the_uninterrupted_one(runs, resumed, uninterrupted):
    (want, _), _ = runs[uninterrupted]
    (got, _), _ = runs[resumed]
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, **SAME, err_msg=f"{resumed}: {name}")


def test_stage3_checkpoint_loads_into_optax(runs):
    """The other framework: optax's Adam state from the 2-rank ZeRO3 files, the same numbers."""
    import jax.numpy as jnp
    import optax

    from hybrid.checkpoint import jax as ckpt_jax

    params = {str(i): {"weight": jnp.zeros(w), "bias": jnp.zeros(b)}
              for i, (w, b) in {0: ((7, 5), (7,)), 2: ((6, 7), (6,)), 4: ((4, 6), (4,))}.items()}
    order = [f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")]
    loaded, state, step = ckpt_jax.load(runs["dir"] / "stage3", params, optax.adam(0.01).init(params), order=order)
    (saved, sd), = [runs["zero3"][1]]
    assert step == SAVE and int(state[0].count) == SAVE
    for i, name in enumerate(order):
        layer, kind = name.split(".")
        assert np.array_equal(np.asarray(loaded[layer][kind]), saved[name]), name
        assert np.array_equal(np.asarray(state[0].mu[layer][kind]), sd[i]["exp_avg"]), name
        assert np.array_equal(np.asarray(state[0].nu[layer][kind]), sd[i]["exp_avg_sq"]), name
