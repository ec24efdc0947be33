"""hybrid.jax.OffloadedZero3: stage 3 with the optimizer state in files, stepped bucket by bucket,
against zero(inner, stage=3) (the same gradients) and the unsharded inner transform."""

import gc
import os
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import hybrid.jax as hj
from tests.jax._jax_model import CAPS, assert_trees_close, loss, make_batch, make_params, reference
from tests.jax.zero3._zero3_run import cut, mesh_of, stage3_train
from tests._procs import finish, start_jax_job

HERE = Path(__file__).parent

NUM_STEPS = 6
# test_jax_zero3.py's tolerance (float32, a few ulps per step), against both references. Against
# zero(stage=3) on the same gradients the arithmetic is the same, elementwise, but each bucket's
# update is a program of its own, which XLA:CPU fuses differently from the one program of all
# buckets and the backward: 1 ulp apart in one element of six at step 2 (adam, 2 devices, measured).
RTOL, ATOL = 1e-6, 2e-7
DECAY = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
LABELS = lambda params: jax.tree.map(lambda p: "matrix" if p.ndim > 1 else "vector", params)

INNER = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=DECAY),
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "partition": lambda: optax.partition({"matrix": optax.adamw(1e-2, weight_decay=0.1),
                                          "vector": optax.sgd(0.05, momentum=0.9)}, LABELS),
}


def _grad_program(mesh, shards):
    return jax.jit(jax.shard_map(jax.grad(hj.gathered(loss)), mesh=mesh, in_specs=(P("dp"), P("dp"), P("dp")),
                                 out_specs=P("dp")))


def _offloaded_run(name, world_size, directory, num_steps=NUM_STEPS):
    mesh = mesh_of(world_size)
    shards = cut(make_params(), mesh)
    opt = hj.OffloadedZero3(INNER[name](), mesh, "dp", directory)
    opt.init(shards)
    grad, history = _grad_program(mesh, shards), []
    for i in range(num_steps):
        shards = opt.step(shards, grad(shards, *make_batch(i)))
        # Copied to the host now: an unsharded leaf may be its bucket itself, which the next step consumes.
        history.append(jax.tree.map(np.asarray, hj.unshard_params(shards)))
    return opt, shards, history


def _resident_run(name, world_size, num_steps=NUM_STEPS):
    mesh = mesh_of(world_size)
    shards = cut(make_params(), mesh)
    init, step = stage3_train(hj.zero(INNER[name](), "dp", stage=3), mesh, shards)
    state, history = init(shards), []
    for i in range(num_steps):
        shards, state = step(shards, state, *make_batch(i))
        history.append(hj.unshard_params(shards))
    return history


@pytest.mark.parametrize("name,world_size", [(n, w) for n in INNER for w in (2, 4)] + [("adamw_mask", 3)])
def test_offloaded_state_steps_as_zero_stage3(name, world_size, tmp_path):
    opt, shards, history = _offloaded_run(name, world_size, tmp_path)
    resident = _resident_run(name, world_size)
    for i, (got, want) in enumerate(zip(history, resident)):
        assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what=f"{name} against zero(stage=3), step {i}")
    for i, (got, want) in enumerate(zip(history, reference(INNER[name](), make_params(), NUM_STEPS))):
        assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what=f"{name}, step {i}")
    assert os.listdir(tmp_path) == []  # the files were unlinked as they were mapped
    assert len(shards.buckets) > 2  # CAPS cut the tiny model into several buckets


def test_the_devices_hold_no_state_between_steps(tmp_path):
    mesh = mesh_of(2)
    shards = cut(make_params(), mesh)
    grad = _grad_program(mesh, shards)
    x, y = make_batch(0)
    device = mesh.devices.flat[0]
    mine = lambda arrays: sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)
    gc.collect()
    # What other tests left alive too (they share the process), held so that no new array can
    # take the id of one freed meanwhile.
    alive = jax.live_arrays()
    before = {id(a) for a in alive}
    opt = hj.OffloadedZero3(optax.adam(1e-2), mesh, "dp", tmp_path)
    opt.init(shards)
    for _ in range(2):
        shards = jax.block_until_ready(opt.step(shards, grad(shards, x, y)))
    gc.collect()
    made = [a for a in jax.live_arrays() if id(a) not in before and not a.is_deleted()]
    # What init and the steps left on device 0: the new parameter slices, nothing of Adam's two
    # moments (each as large as the slices) or of the gradients.
    assert mine(a for a in made if not any(a is b for b in shards.buckets)) == 0, made
    assert mine(made) == mine(shards.buckets) > 0
    padded = sum(b.shape[0] for b in shards.buckets)  # global elements of all buckets
    assert opt.offloaded_bytes() >= 2 * 4 * padded  # mu and nu of every slice, in files


def test_global_norm_clip_steps_as_zero_stage3(tmp_path):
    """optax's chain as users write it, its clip split as DeepSpeed's offload splits it: every
    bucket's squared norm first, then each bucket stepped with the global factor. A max norm of
    0.05 clips on every step (the gradients' norm is 0.3-1), so a per-bucket norm would show."""
    INNER["clip_adam"] = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    try:
        _, _, history = _offloaded_run("clip_adam", 4, tmp_path)
        for i, (got, want) in enumerate(zip(history, _resident_run("clip_adam", 4))):
            assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what=f"against zero(stage=3), step {i}")
        want_history = reference(INNER["clip_adam"](), make_params(), NUM_STEPS)
        for i, (got, want) in enumerate(zip(history, want_history)):
            assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what=f"against optax, step {i}")
    finally:
        del INNER["clip_adam"]


def test_apply_if_finite_skips_every_bucket_at_once(tmp_path):
    """One NaN in one bucket's gradient skips the step on every bucket, as zero(stage=3) does; the
    counters match; a finite step after it updates all buckets."""
    mesh = mesh_of(4)
    # the chain as users write it inside hybrid's skip: optax's clip (rewritten) and a masked AdamW
    make = lambda: hj.apply_if_finite(optax.chain(optax.clip_by_global_norm(0.05),
                                                  optax.adamw(1e-2, weight_decay=0.1, mask=DECAY)), 3, "dp")
    shards = cut(make_params(), mesh)
    opt = hj.OffloadedZero3(make(), mesh, "dp", tmp_path)
    opt.init(shards)
    tx = hj.zero(make(), "dp", stage=3)
    specs = hj.state_specs(tx, shards, "dp", axis_size=4)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs))

    def resident_step(shards, state, grads):
        u, state = tx.update(grads, state, shards)
        return optax.apply_updates(shards, u), state

    resident_step = jax.jit(jax.shard_map(resident_step, mesh=mesh, in_specs=(P("dp"), specs, P("dp")),
                                          out_specs=(P("dp"), specs)))
    grad, resident, state = _grad_program(mesh, shards), shards, init(shards)
    for i in range(4):
        g = grad(shards, *make_batch(i))
        if i == 1:  # a NaN in the last bucket alone
            last = g.buckets[-1].at[0].set(np.nan)
            g = hj.ParamShards((*g.buckets[:-1], last), g.layout)
        before = [np.asarray(b) for b in shards.buckets]
        copy = jax.tree.map(lambda a: a.copy(), g)
        resident, state = resident_step(resident, state, copy)
        shards = opt.step(shards, g)
        if i == 1:
            assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, shards.buckets))
        assert_trees_close(hj.unshard_params(shards), hj.unshard_params(resident), rtol=RTOL, atol=ATOL,
                           what=f"step {i}")
    saved = opt.zero_state().inner
    assert int(saved.total_notfinite) == int(state.inner.total_notfinite) == 1


@pytest.mark.parametrize("inner,culprit", [
    # the clip after adam's scaling: its norm needs every bucket's new state before any bucket steps
    (lambda: optax.chain(optax.scale_by_adam(), hj.clip_by_global_norm(1.0, "dp"), optax.scale(-1e-2)),
     "a stateful transform before it.*Put it first in the chain"),
    # a global statistic hybrid does not know how to sum over buckets (exact on zero's slices)
    (lambda: optax.stateless(lambda u, p: jax.tree.map(
        lambda x: x / jax.lax.psum(sum(jax.numpy.sum(y) for y in jax.tree.leaves(u)), "dp"), u)),
     "cannot be split.*takes no decision hybrid knows"),
])
def test_a_transform_that_cannot_be_split_is_refused_saying_why(inner, culprit, tmp_path):
    with pytest.raises(ValueError, match=culprit):
        hj.OffloadedZero3(inner(), mesh_of(2), "dp", tmp_path)


def test_bad_directories_axes_and_plans_are_named(tmp_path):
    mesh = mesh_of(2)
    with pytest.raises(ValueError, match=f"offload_dir={str(tmp_path / 'missing')!r} is not a directory"):
        hj.OffloadedZero3(optax.adam(1e-2), mesh, "dp", tmp_path / "missing")
    from hybrid.core._state_dir import filesystem_type
    if filesystem_type("/dev/shm") == "tmpfs":  # files there live in memory: the user is told, by name
        with pytest.warns(UserWarning, match=r"offload_dir='/dev/shm' is on tmpfs, whose files live in memory"):
            hj.OffloadedZero3(optax.adam(1e-2), mesh, "dp", "/dev/shm")
    with pytest.raises(ValueError, match="axis_name='batch' is not an axis of the mesh"):
        hj.OffloadedZero3(optax.adam(1e-2), mesh, "batch", tmp_path)
    opt = hj.OffloadedZero3(optax.adam(1e-2), mesh, "dp", tmp_path)
    shards = cut(make_params(), mesh)
    with pytest.raises(ValueError, match="call init"):
        opt.step(shards, shards)
    opt.init(shards)
    other = cut(make_params(), mesh, bucket_cap_bytes=1 << 20, first_bucket_cap_bytes=1 << 20)
    with pytest.raises(ValueError, match="differs from the one init saw"):
        opt.step(other, other)
    with pytest.raises(ValueError, match="the gradients must be ParamShards of the shards' plan"):
        opt.step(shards, other)
    with pytest.raises(ValueError, match="cut for axis 'dp' of size 4"):
        hj.OffloadedZero3(optax.adam(1e-2), mesh, "dp", tmp_path).init(cut(make_params(), mesh_of(4)))


def test_checkpoints_move_between_offloaded_and_resident_stage3(tmp_path):
    # A run saves its offloaded state with hybrid.checkpoint.jax.save (zero_state(): zero(stage=3)'s
    # tree); a fresh offloaded run and a resident zero(stage=3) run load it and go on.
    from hybrid.checkpoint import jax as ckpt_jax

    mesh = mesh_of(2)
    grad = _grad_program(mesh, cut(make_params(), mesh))
    first = hj.OffloadedZero3(optax.adamw(1e-2, weight_decay=0.1, mask=DECAY), mesh, "dp", tmp_path)
    shards = cut(make_params(), mesh)
    first.init(shards)
    for i in range(3):
        shards = first.step(shards, grad(shards, *make_batch(i)))
    ckpt_jax.save(tmp_path / "ckpt", shards, first.zero_state(), step=3, stage=3)
    for i in range(3, 6):
        shards = first.step(shards, grad(shards, *make_batch(i)))
    want = jax.tree.map(np.asarray, hj.unshard_params(shards))

    second = hj.OffloadedZero3(optax.adamw(1e-2, weight_decay=0.1, mask=DECAY), mesh, "dp", tmp_path)
    fresh = cut(make_params(seed=5), mesh)
    second.init(fresh)
    loaded, state, at = ckpt_jax.load(tmp_path / "ckpt", fresh, second.zero_state())
    second.load_zero_state(state)
    del state
    for i in range(at, 6):
        loaded = second.step(loaded, grad(loaded, *make_batch(i)))
    for a, b in zip(jax.tree.leaves(hj.unshard_params(loaded)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # the same programs on the same numbers

    tx = hj.zero(optax.adamw(1e-2, weight_decay=0.1, mask=DECAY), "dp", stage=3)
    init, step = stage3_train(tx, mesh, fresh_resident := cut(make_params(seed=5), mesh))
    resident, state, at = ckpt_jax.load(tmp_path / "ckpt", fresh_resident, init(fresh_resident))
    for i in range(at, 6):
        resident, state = step(resident, state, *make_batch(i))
    assert_trees_close(hj.unshard_params(resident), want, rtol=RTOL, atol=ATOL, what="resident after the load")

    # hybrid.checkpoint.jax.load(path, shards, opt) streams into the files, a slot at a time, at
    # the saved device count and at another (resharded on the way).
    for world in (2, 4):
        m = mesh_of(world)
        third = hj.OffloadedZero3(optax.adamw(1e-2, weight_decay=0.1, mask=DECAY), m, "dp", tmp_path)
        template = cut(make_params(seed=5), m)
        if world == 4:  # shapes alone: nothing of a model is built before the load
            template = hj.abstract_shards(make_params(), mesh=m, axis_name="dp", **CAPS)
        third.init(template)
        streamed, same, at = ckpt_jax.load(tmp_path / "ckpt", template, third)
        assert same is third and at == 3
        g = _grad_program(m, streamed)
        for i in range(at, 6):
            streamed = third.step(streamed, g(streamed, *make_batch(i)))
        got = hj.unshard_params(streamed)
        if world == 2:  # the same programs on the same numbers as the run that saved
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(np.asarray(a), b)
        else:
            assert_trees_close(got, want, rtol=RTOL, atol=ATOL, what="streamed into 4 devices")
    with pytest.raises(ValueError, match="through a mapping goes into an OffloadedZero3 in two steps"):
        ckpt_jax.load(tmp_path / "ckpt", template, third, mapping=hj.specs)

    with pytest.raises(ValueError, match="differs from the shards'"):
        other = hj.OffloadedZero3(optax.adamw(1e-2, weight_decay=0.1, mask=DECAY), mesh, "dp", tmp_path)
        other.init(cut(make_params(), mesh, bucket_cap_bytes=1 << 20, first_bucket_cap_bytes=1 << 20))
        other.load_zero_state(state)


@pytest.mark.timeout(150)
def test_offloaded_state_across_processes(tmp_path):
    # 2 processes of 2 devices (jax.distributed, gloo): each keeps its devices' state in its own
    # files, steps as zero(stage=3), saves, and loads a slot at a time (_jax_offload_worker.py).
    outs = finish(start_jax_job(HERE / "_jax_offload_worker.py", 2, str(tmp_path)), "offloaded", timeout_s=120)
    for i, out in enumerate(outs):
        assert f"process {i}: ok" in out, out[-2000:]
