"""The twin models trained with hybrid's JAX frontend: ``hybrid.jax.zero`` over a ``shard_map`` mesh.

A run is: build the step and state from numpy arrays (:func:`build_jax`) -> [load state] ->
:func:`train_jax_steps` -> [save state] -> :class:`~hybrid.demo.TrainResult`; :func:`train_jax`
does all of it. The mesh is this process's first ``num_devices`` devices, or any mesh with an
axis ``"dp"`` (one spanning processes after ``jax.distributed.initialize``).

What a run needs of the model is a :class:`JaxModel`: the MLP's here, the GPT's (flax, through
the declared mapping) in ``_gpt_jax.py``. Either plans its buckets as torch's DDP holds them after
its first iteration: from the order its backward computes gradients
(``hybrid.jax.gradient_ready_order``), at the config's caps (torch's default ones by default).
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.core import BucketPlan
from hybrid.jax._specs import _Layout
from hybrid.demo._checkpointing import Checkpointing
from hybrid.demo._jax_model import JaxModel, bucket_caps, host
from hybrid.demo._model import TrainConfig, TrainResult, batch, initial_params
from hybrid.models._mlp import param_order
from hybrid.models._mlp_jax import cross_entropy, jax_params

AXIS = "dp"
Progress = Callable[[int, float], None]


def numpy_params(tree) -> dict[str, np.ndarray]:
    """Back to numpy by name, in registration order (this process's copy of replicated arrays)."""
    return {f"layers.{i}.{k}": host(layer[k]) for i, layer in enumerate(tree["layers"]) for k in ("weight", "bias")}


def pin_jax_numerics() -> None:
    """float32 matmuls at full precision, so JAX computes what torch's CPU GEMM computes."""
    jax.config.update("jax_default_matmul_precision", "highest")


@functools.lru_cache(maxsize=16)
def mlp_ready_order(sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The MLP's parameters in the order its JAX backward computes their gradients: torch's
    autograd makes them ready in the same order (last layer first, a bias before its weight).

    >>> mlp_ready_order((3, 4, 2))
    ('layers.1.bias', 'layers.1.weight', 'layers.0.bias', 'layers.0.weight')
    """
    sds = jax.ShapeDtypeStruct
    tree = {"layers": [{"weight": sds((n_out, n_in), jnp.float32), "bias": sds((n_out,), jnp.float32)}
                       for n_in, n_out in zip(sizes, sizes[1:])]}
    x, y = sds((2, sizes[0]), jnp.float32), sds((2,), jnp.int32)
    return tuple(hj.gradient_ready_order(cross_entropy, tree, x, y))


def jax_model(config: TrainConfig, params: dict[str, np.ndarray] | None = None) -> JaxModel:
    """The config's model on the JAX side. The GPT's pairs its tree with the torch model's
    parameters, whose names and registration order ``params`` gives (default
    :func:`~hybrid.demo.initial_params`, which builds the torch model)."""
    if config.gpt is not None:
        from hybrid.demo._gpt_jax import gpt_model
        return gpt_model(config, initial_params(config) if params is None else params)
    layout = dict(order=param_order(config.sizes), ready_order=mlp_ready_order(tuple(config.sizes)),
                  **bucket_caps(config))
    return JaxModel(jax_params, numpy_params, cross_entropy, layout)


def zero_layout(config: TrainConfig, params: dict[str, np.ndarray] | None = None) -> dict:
    """What :func:`make_optimizer` gives ``zero`` to plan its buckets (``order``, ``ready_order``,
    ``pairing``, caps): also what ``hybrid.checkpoint.jax.save`` / ``load`` need to find the layout
    of its state."""
    return jax_model(config, params).layout


def make_optimizer(config: TrainConfig, layout: dict | None = None) -> optax.GradientTransformation:
    """``hybrid.jax.zero`` of optax's adam / adamw (after ``hybrid.jax.clip_by_global_norm``, exact
    on shards, when ``clip_norm``), planned by ``layout`` (default :func:`zero_layout`): the
    buckets torch's DDP holds after its rebuild.

    >>> from hybrid.demo import TrainConfig
    >>> tx = make_optimizer(TrainConfig(optimizer="adamw", weight_decay=0.1, clip_norm=1.0))
    """
    b1, b2 = config.betas
    if config.optimizer == "adam":
        inner = optax.adam(config.lr, b1=b1, b2=b2, eps=config.eps)
    else:
        inner = optax.adamw(config.lr, b1=b1, b2=b2, eps=config.eps, weight_decay=config.weight_decay)
    if config.clip_norm is not None:
        inner = optax.chain(hj.clip_by_global_norm(config.clip_norm, AXIS), inner)
    if config.stage == 3:  # the plan travels with the ParamShards (shard_params), not with zero
        return hj.zero(inner, AXIS, stage=3)
    return hj.zero(inner, AXIS, stage=config.stage, **(zero_layout(config) if layout is None else layout))


def ensure_host_devices(num_devices: int) -> None:
    """Give JAX's CPU platform at least ``num_devices`` devices, if JAX has not started its backends
    yet (``import jax`` alone does not; the first array or device query does).

    What a script would do by hand (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before
    jax is imported, or ``jax.config.update("jax_num_cpu_devices", N)`` right after), done for it;
    a larger count already asked for is kept. Once the backends run their device count is fixed:
    then nothing changes, and :func:`host_mesh` says what to do if there are too few.
    """
    flags = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if max(jax.config.jax_num_cpu_devices, int(flags.group(1)) if flags else 1) >= num_devices:
        return
    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:  # the backends are up already: their devices are what they are
        pass


def host_mesh(num_devices: int) -> Mesh:
    """A 1-D mesh ``("dp",)`` of this process's first ``num_devices`` devices."""
    devices = jax.devices()
    if len(devices) < num_devices:
        raise ValueError(f"num_devices={num_devices} but JAX sees {len(devices)} device(s); on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} before importing jax")
    return Mesh(np.array(devices[:num_devices]), (AXIS,))


def global_array(x, mesh: Mesh, spec: P) -> jax.Array:
    """``x`` (numpy, the same in every process) as a global array laid out by ``spec`` on ``mesh``."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


class JaxTraining(NamedTuple):
    """A built run: the jitted ``step(params, state, x, y) -> (params, state, loss)``, its current
    params and optimizer state (global arrays), the mesh, the model and the bucket plan."""

    step: Callable
    params: dict
    state: object
    mesh: Mesh
    model: JaxModel
    plan: BucketPlan


def build_jax(config: TrainConfig, mesh: Mesh, params: dict[str, np.ndarray] | None = None) -> JaxTraining:
    """The jitted step and the initial state of ``config`` on ``mesh`` (axis ``"dp"``), from
    ``params`` (default :func:`init_params` of the config); at stage 3 the run's params are the
    global ``ParamShards``. A checkpoint's state replaces ``state`` between this and
    :func:`train_jax_steps`."""
    pin_jax_numerics()
    if params is None:
        params = initial_params(config)
    model = jax_model(config, params)
    tree = model.tree(params)
    if config.stage == 3:
        return _build_stage3(config, mesh, model, tree)
    tx = make_optimizer(config, model.layout)
    specs = hj.state_specs(tx, tree, AXIS, axis_size=mesh.size)

    def step(params, state, x, y):
        grads, loss = hj.local_grad(lambda p: (model.loss(p, x, y),) * 2, AXIS, has_aux=True)(params)
        updates, state = tx.update(grads, state, params)
        # The mean of the per-device means: the global loss DDP reports the same way.
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS)

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
                                 out_specs=(P(), specs, P())), donate_argnums=(0, 1))
    plan = _Layout.of(tree, what="build_jax", **model.layout).plan
    tree = jax.tree_util.tree_map(lambda x: global_array(x, mesh, P()), tree)
    return JaxTraining(step, tree, init(tree), mesh, model, plan)


def _build_stage3(config: TrainConfig, mesh: Mesh, model: JaxModel, tree) -> JaxTraining:
    """Stage 3: the params are ``ParamShards`` cut by ``shard_params`` (torch ZeRO3's plan over
    torch's registration ``order``, or the GPT's ``pairing`` to torch's names and layouts, at the
    config's cap where it sets one), the loss gathers them per bucket and its gradient comes back
    as slices. The run's ``model`` names the shards (unsharded) and has no layout: the saved plan
    is the shards' own."""
    cut_with = {k: model.layout[k] for k in ("order", "pairing") if model.layout.get(k) is not None}
    if config.bucket_cap_bytes is not None:
        cut_with.update(bucket_caps(config))
    cut = jax.jit(jax.shard_map(lambda p: hj.shard_params(p, AXIS, **cut_with), mesh=mesh, in_specs=P(),
                                out_specs=P(AXIS)))
    shards = cut(jax.tree_util.tree_map(lambda x: global_array(x, mesh, P()), tree))
    tx = make_optimizer(config)
    specs = hj.state_specs(tx, shards, AXIS, axis_size=mesh.size)
    loss_of_shards = hj.gathered(model.loss)

    def step(shards, state, x, y):
        loss, grads = jax.value_and_grad(loss_of_shards)(shards, x, y)
        updates, state = tx.update(grads, state, shards)
        return optax.apply_updates(shards, updates), state, jax.lax.pmean(loss, AXIS)

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(AXIS), out_specs=specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
                                 out_specs=(P(AXIS), specs, P())), donate_argnums=(0, 1))
    def named(shards):
        return model.named(hj.unshard_params(shards))

    return JaxTraining(step, shards, init(shards), mesh, model._replace(named=named, layout={}),
                       shards.layout.layout.plan)


def train_jax_steps(run: JaxTraining, config: TrainConfig, start_step: int, stop_step: int, *,
                    progress: Progress | None = None) -> tuple[JaxTraining, np.ndarray]:
    """Steps ``[start_step, stop_step)``: the run with its new params and state, and the losses."""
    params, state, losses = run.params, run.state, []
    for i in range(start_step, stop_step):
        # int64 labels and tokens as int32, JAX's default integer width
        x, y = (a.astype(np.int32) if a.dtype == np.int64 else a for a in batch(config, i))
        params, state, loss = run.step(params, state, global_array(x, run.mesh, P(AXIS)),
                                       global_array(y, run.mesh, P(AXIS)))
        losses.append(float(loss.addressable_data(0)))
        if progress is not None:
            progress(i, losses[-1])
    return run._replace(params=params, state=state), np.asarray(losses)


def save_checkpoint(path: str, run: JaxTraining, config: TrainConfig, step: int):
    """Save ``run``'s params and zero state (every device's slices, one file each) at ``step``."""
    from hybrid.checkpoint import jax as checkpoint
    hyper = dict(lr=config.lr, betas=list(config.betas), eps=config.eps, weight_decay=config.weight_decay)
    return checkpoint.save(path, run.params, run.state, step=step, stage=config.stage, optimizer=config.optimizer,
                           hyperparameters=hyper, metadata={"config": config.to_json()}, **run.model.layout)


def load_checkpoint(path: str, run: JaxTraining) -> tuple[JaxTraining, int]:
    """``run`` with params and state loaded from a checkpoint (either frontend, any world size)."""
    from hybrid.checkpoint import jax as checkpoint
    params, state, step = checkpoint.load(path, run.params, run.state, **run.model.layout)
    return run._replace(params=params, state=state), step


def train_jax(config: TrainConfig, *, num_devices: int = 2, mesh: Mesh | None = None,
              params: dict[str, np.ndarray] | None = None, start_step: int = 0,
              progress: Progress | None = None, resume: str | None = None, save_to: str | None = None,
              save_at: int | None = None, checkpoint_dir: str | None = None,
              save_every: int | None = None) -> TrainResult:
    """Train ``config`` from ``start_step`` to ``config.num_steps`` with ``hybrid.jax.zero`` over
    ``mesh`` (default: :func:`host_mesh` of ``num_devices``); device ``r`` gets rank ``r``'s rows.

    ``resume`` loads a checkpoint (saved by either frontend at any world size) and starts from its
    step; ``save_to`` saves one after step ``save_at`` (default the last) and training goes on;
    ``checkpoint_dir`` and ``save_every`` as for :func:`hybrid.demo.train_torch` (saves every
    that many steps, and a relaunch resumes from the newest).

    >>> from hybrid.demo import TrainConfig
    >>> r = train_jax(TrainConfig(num_steps=20, stage=2), num_devices=2)
    >>> len(r.losses), bool(r.losses[-1] < r.losses[0])
    (20, True)
    """
    saves = Checkpointing(resume, save_to, save_at, checkpoint_dir, save_every)
    run = build_jax(config, host_mesh(num_devices) if mesh is None else mesh, params)
    resume = saves.resume_path()
    if resume is not None:
        run, start_step = load_checkpoint(resume, run)
    t0 = time.perf_counter()
    losses = []
    for lo, hi, where in saves.segments(start_step, config.num_steps):
        run, part = train_jax_steps(run, config, lo, hi, progress=progress)
        losses.append(part)
        if where is not None:
            save_checkpoint(where, run, config, hi)
    seconds = time.perf_counter() - t0
    return TrainResult(np.concatenate(losses), run.model.named(run.params), run.plan.fingerprint(), seconds,
                       start_step, run.plan)
