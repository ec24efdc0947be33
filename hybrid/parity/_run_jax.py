"""The JAX side of a parity run: ``hybrid.jax.zero`` (or ``bucketed_all_reduce``) under ``shard_map``
over this process's first devices, planned as torch's DDP plans after its rebuild; at stage 3,
``zero(..., stage=3)`` on :func:`hybrid.jax.shard_params`' slices, planned as torch's ZeRO3.

The plan: the gradient-ready order of the user's own backward (:func:`hybrid.jax.gradient_ready_order`)
and the pairing with torch's tensors (``pairing=``), at torch's default caps, so the buckets and
their fingerprint are those of the torch side (stage 3: ``hybrid.core.zero3_plan`` through the
pairing, ZeRO3's default). Device ``r`` gets rank ``r``'s rows of each global batch; matmuls run
at float32 ("highest") precision while the step is traced.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES
from hybrid.demo import host_mesh
from hybrid.jax._specs import _Layout, _leaves
from hybrid.parity._report import SideRun
from hybrid.parity._spec import rank_rows, tree_map

AXIS = "dp"
CAPS = dict(bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES, first_bucket_cap_bytes=DEFAULT_FIRST_BUCKET_CAP_BYTES)


def _host(x) -> np.ndarray:
    """A batch array as JAX takes it: 64-bit types at 32 bits unless jax_enable_x64 is on."""
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def _global(tree, mesh: Mesh, spec: P):
    def put(x):
        x = _host(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])
    return tree_map(put, tree)


def _replicated(params, mesh: Mesh):
    """The params on every device: any pytree (a flax NNX State too), where batches are dicts and lists."""
    return jax.tree.map(lambda x: _global(x, mesh, P()), params)


def _transform(setup, params, ready, stage: int) -> optax.GradientTransformation:
    inner = setup.optimizer.optax(params)
    if stage == 0:  # DDP alone: every device reduces the whole gradient and runs the optimizer
        return optax.chain(hj.bucketed_all_reduce(AXIS, ready_order=ready, pairing=setup.pairing, **CAPS), inner)
    return hj.zero(inner, AXIS, stage=stage, ready_order=ready, pairing=setup.pairing, **CAPS)


def plan_fingerprint(setup, ready) -> str:
    """The fingerprint of the bucket plan the JAX side packs: torch's names, ready order, caps."""
    return _Layout.of(setup.jax_params, what="parity", order=None, ready_order=ready, pairing=setup.pairing,
                      **CAPS).plan.fingerprint()


def _stage3(setup, mesh: Mesh, num_devices: int):
    """``(init, step, shards, fingerprint)`` of stage 3: the ParamShards of the setup's params on
    ZeRO3's plan, and the jitted steps that train them."""
    loss_fn = setup.jax_loss
    tx = hj.zero(setup.optimizer.optax(setup.jax_params), AXIS, stage=3)
    cut = jax.jit(jax.shard_map(lambda p: hj.shard_params(p, AXIS, pairing=setup.pairing), mesh=mesh, in_specs=P(),
                                out_specs=P(AXIS)))
    shards = cut(_replicated(setup.jax_params, mesh))
    specs = hj.state_specs(tx, shards, AXIS, axis_size=num_devices)
    loss_of_shards = hj.gathered(loss_fn)  # gathers per bucket; its backward reduce-scatters

    def step(shards, state, batch):
        loss, grads = jax.value_and_grad(loss_of_shards)(shards, batch)
        updates, state = tx.update(grads, state, shards)
        return optax.apply_updates(shards, updates), state, jax.lax.pmean(loss, AXIS)

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(AXIS), out_specs=specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS), specs, P(AXIS)),
                                 out_specs=(P(AXIS), specs, P())), donate_argnums=(0, 1))
    return init, step, shards, shards.layout.layout.plan.fingerprint()


def train_jax(setup, *, num_devices: int = 2, stage: int = 1, resume=None, save_at: int | None = None,
              save_to=None, progress=None) -> SideRun:
    """Train ``setup`` (a :class:`hybrid.parity.ParitySetup`) on ``num_devices`` devices.

    ``resume``: a checkpoint (either frontend's, any world size) to start from, loaded through the
    pairing; ``save_to``: save one after step ``save_at`` (under torch's names and layouts).
    ``progress(step, loss)`` after each step.
    """
    mesh = host_mesh(num_devices)  # axis "dp"
    loss_fn, params = setup.jax_loss, setup.jax_params
    example = tree_map(lambda x: jnp.asarray(_host(x)), rank_rows(setup.batches[0], 0, num_devices))
    with jax.default_matmul_precision("highest"):
        if stage == 3:
            # the plan travels with the shards: checkpoints take them as they are (torch's names)
            ready, crossing = None, {}
            init, step, params, fingerprint = _stage3(setup, mesh, num_devices)
        else:
            ready = hj.gradient_ready_order(loss_fn, params, example)
            crossing = dict(mapping=setup.pairing, ready_order=ready)
            init, step = _step(setup, mesh, num_devices, ready, stage)
            # jax.tree.map: the params may be any pytree (a flax NNX State), the batches dicts and lists
            params, fingerprint = _replicated(params, mesh), plan_fingerprint(setup, ready)
        state = init(params)
        start = 0
        if resume is not None:
            from hybrid.checkpoint import jax as checkpoint
            params, state, start = checkpoint.load(resume, params, state, **crossing)
        losses = []
        t0 = time.perf_counter()
        for i in range(start, len(setup.batches)):
            params, state, loss = step(params, state, _global(setup.batches[i], mesh, P(AXIS)))
            losses.append(float(loss))
            if progress is not None:
                progress(i, losses[-1])
            if save_to is not None and i + 1 == save_at:
                from hybrid.checkpoint import jax as checkpoint
                checkpoint.save(save_to, params, state, step=i + 1, stage=stage or None, optimizer=setup.optimizer.name,
                                hyperparameters=setup.optimizer.torch_group(), **crossing)
        seconds = time.perf_counter() - t0
    if stage == 3:
        params = hj.unshard_params(params)
    names, leaves, _ = _leaves(params)
    named = setup.pairing.to_torch({n: np.asarray(x) for n, x in zip(names, leaves)})
    return SideRun(f"jax, {num_devices} device{'s' * (num_devices > 1)}", start, tuple(losses), named,
                   fingerprint, seconds)


def _step(setup, mesh: Mesh, num_devices: int, ready, stage: int):
    """``(init, step)`` of stages 0-2: replicated params, per-device gradients, ``zero`` (or
    ``bucketed_all_reduce``) planned as torch's DDP after its rebuild."""
    loss_fn, params = setup.jax_loss, setup.jax_params
    tx = _transform(setup, params, ready, stage)
    specs = hj.state_specs(tx, params, AXIS, axis_size=num_devices)

    def step(params, state, batch):
        grads, loss = hj.local_grad(lambda p: (loss_fn(p, batch),) * 2, AXIS, has_aux=True)(params)
        updates, state = tx.update(grads, state, params)
        # the mean of the devices' means: the global loss, as the torch side reports it
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS)

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs, P())),
                   donate_argnums=(0, 1))
    return init, step

