"""The twin model trained with hybrid's JAX frontend: ``hybrid.jax.zero`` over a ``shard_map`` mesh.

A run is: build the step and state from numpy arrays (:func:`build_jax`) -> [load state] ->
:func:`train_jax_steps` -> [save state] -> :class:`~hybrid.demo.TrainResult`; :func:`train_jax`
does all of it. The mesh is this process's first ``num_devices`` devices, or any mesh with an
axis ``"dp"`` (one spanning processes after ``jax.distributed.initialize``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hybrid.jax as hj
from hybrid.jax._specs import _Layout
from hybrid.demo._model import TrainConfig, TrainResult, global_batch, init_params, param_order

AXIS = "dp"
Progress = Callable[[int, float], None]


def jax_params(params: dict[str, np.ndarray]) -> dict:
    """The pytree the JAX twin reads: ``{"layers": [{"weight": w, "bias": b}, ...]}``, whose key
    paths (``hybrid.jax.specs``) are torch's names: ``layers.0.weight`` ...

    >>> from hybrid.demo import init_params
    >>> [s.name for s in hj.specs(jax_params(init_params(0, (3, 2))))]
    ['layers.0.bias', 'layers.0.weight']
    """
    n = len(params) // 2
    return {"layers": [{"weight": jnp.asarray(params[f"layers.{i}.weight"]),
                        "bias": jnp.asarray(params[f"layers.{i}.bias"])} for i in range(n)]}


def numpy_params(tree) -> dict[str, np.ndarray]:
    """Back to numpy by name, in registration order (this process's copy of replicated arrays)."""
    local = lambda x: np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
    return {f"layers.{i}.{k}": local(layer[k]) for i, layer in enumerate(tree["layers"]) for k in ("weight", "bias")}


def mlp_logits(params, x):
    """The twin MLP: ``x @ W.T + b`` per layer (``nn.Linear``), tanh between layers."""
    layers = params["layers"]
    for i, layer in enumerate(layers):
        x = x @ layer["weight"].T + layer["bias"]
        if i < len(layers) - 1:
            x = jnp.tanh(x)
    return x


def cross_entropy(params, x, y):
    """Mean cross-entropy over the rows given (``torch.nn.functional.cross_entropy``'s mean)."""
    return optax.losses.softmax_cross_entropy_with_integer_labels(mlp_logits(params, x), y).mean()


def pin_jax_numerics() -> None:
    """float32 matmuls at full precision, so JAX computes what torch's CPU GEMM computes."""
    jax.config.update("jax_default_matmul_precision", "highest")


def zero_layout(config: TrainConfig) -> dict:
    """The ``order`` and bucket caps :func:`make_optimizer` gives ``zero``: also what
    ``hybrid.checkpoint.jax.save`` / ``load`` need to find the layout of its state."""
    return dict(order=param_order(config.sizes), bucket_cap_bytes=config.bucket_cap_bytes,
                first_bucket_cap_bytes=config.bucket_cap_bytes)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """``hybrid.jax.zero`` of optax's adam / adamw (after ``hybrid.jax.clip_by_global_norm``, exact
    on shards, when ``clip_norm``), with the torch side's caps and registration order.

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
    return hj.zero(inner, AXIS, stage=config.stage, **zero_layout(config))


def plan_fingerprint(config: TrainConfig) -> str:
    """Fingerprint of the bucket plan ``make_optimizer(config)`` packs and shards by."""
    tree = jax_params(init_params(config.seed, config.sizes))
    return _Layout.of(tree, what="plan_fingerprint", **zero_layout(config)).plan.fingerprint()


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
    params and optimizer state (global arrays), and the mesh."""

    step: Callable
    params: dict
    state: object
    mesh: Mesh


def build_jax(config: TrainConfig, mesh: Mesh, params: dict[str, np.ndarray] | None = None) -> JaxTraining:
    """The jitted step and the initial state of ``config`` on ``mesh`` (axis ``"dp"``), from
    ``params`` (default :func:`init_params` of the config). A checkpoint's state replaces
    ``state`` between this and :func:`train_jax_steps`."""
    pin_jax_numerics()
    if params is None:
        params = init_params(config.seed, config.sizes)
    tree = jax_params(params)
    tx = make_optimizer(config)
    specs = hj.state_specs(tx, tree, AXIS, axis_size=mesh.size)

    def step(params, state, x, y):
        grads, loss = hj.local_grad(lambda p: (cross_entropy(p, x, y),) * 2, AXIS, has_aux=True)(params)
        updates, state = tx.update(grads, state, params)
        # The mean of the per-device means: the global loss DDP reports the same way.
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS)

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
                                 out_specs=(P(), specs, P())), donate_argnums=(0, 1))
    tree = jax.tree_util.tree_map(lambda x: global_array(x, mesh, P()), tree)
    return JaxTraining(step, tree, init(tree), mesh)


def train_jax_steps(run: JaxTraining, config: TrainConfig, start_step: int, stop_step: int, *,
                    progress: Progress | None = None) -> tuple[JaxTraining, np.ndarray]:
    """Steps ``[start_step, stop_step)``: the run with its new params and state, and the losses."""
    params, state, losses = run.params, run.state, []
    for i in range(start_step, stop_step):
        x, y = global_batch(config.seed, i, config.sizes, config.global_batch_size)
        params, state, loss = run.step(params, state, global_array(x, run.mesh, P(AXIS)),
                                       global_array(y.astype(np.int32), run.mesh, P(AXIS)))
        losses.append(float(loss.addressable_data(0)))
        if progress is not None:
            progress(i, losses[-1])
    return run._replace(params=params, state=state), np.asarray(losses)


def save_checkpoint(path: str, run: JaxTraining, config: TrainConfig, step: int):
    """Save ``run``'s params and zero state (every device's slices, one file each) at ``step``."""
    from hybrid.checkpoint import jax as checkpoint
    hyper = dict(lr=config.lr, betas=list(config.betas), eps=config.eps, weight_decay=config.weight_decay)
    return checkpoint.save(path, run.params, run.state, step=step, stage=config.stage, optimizer=config.optimizer,
                           hyperparameters=hyper, metadata={"config": config.to_json()}, **zero_layout(config))


def load_checkpoint(path: str, run: JaxTraining, config: TrainConfig) -> tuple[JaxTraining, int]:
    """``run`` with params and state loaded from a checkpoint (either frontend, any world size)."""
    from hybrid.checkpoint import jax as checkpoint
    params, state, step = checkpoint.load(path, run.params, run.state, **zero_layout(config))
    return run._replace(params=params, state=state), step


def train_jax(config: TrainConfig, *, num_devices: int = 2, mesh: Mesh | None = None,
              params: dict[str, np.ndarray] | None = None, start_step: int = 0,
              progress: Progress | None = None, resume: str | None = None, save_to: str | None = None,
              save_at: int | None = None) -> TrainResult:
    """Train ``config`` from ``start_step`` to ``config.num_steps`` with ``hybrid.jax.zero`` over
    ``mesh`` (default: :func:`host_mesh` of ``num_devices``); device ``r`` gets rank ``r``'s rows.

    ``resume`` loads a checkpoint (saved by either frontend at any world size) and starts from its
    step; ``save_to`` saves one after step ``save_at`` (default the last) and training goes on.

    >>> from hybrid.demo import TrainConfig
    >>> r = train_jax(TrainConfig(num_steps=20, stage=2), num_devices=2)
    >>> len(r.losses), bool(r.losses[-1] < r.losses[0])
    (20, True)
    """
    run = build_jax(config, host_mesh(num_devices) if mesh is None else mesh, params)
    if resume is not None:
        run, start_step = load_checkpoint(resume, run, config)
    save_at = config.num_steps if save_at is None else save_at
    t0 = time.perf_counter()
    losses = []
    for lo, hi in ((start_step, save_at), (save_at, config.num_steps)) if save_to else ((start_step, config.num_steps),):
        run, part = train_jax_steps(run, config, lo, hi, progress=progress)
        losses.append(part)
        if save_to and hi == save_at:
            save_checkpoint(save_to, run, config, save_at)
    seconds = time.perf_counter() - t0
    return TrainResult(np.concatenate(losses), numpy_params(run.params), plan_fingerprint(config), seconds, start_step)
