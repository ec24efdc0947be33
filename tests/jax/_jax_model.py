"""A tiny MLP, its data and the unsharded reference every jax test compares against."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import hybrid.jax as hj

# Small caps so the 26 parameters fall into several buckets whose lengths 3 and 4 do not divide.
CAPS = dict(bucket_cap_bytes=40, first_bucket_cap_bytes=16)
BATCH = 12  # divisible by every world size tested (2, 3, 4): equal local batches


def jitted(fun, **kwargs):
    """``jax.jit(fun, **kwargs)``: every program of the suite compiles with XLA:CPU's quick code
    generation through ``XLA_FLAGS`` (tests/_xla.py, set by the conftest and handed to every JAX
    process a test starts), so no program names it again. One set of compile options for all also
    gives one compilation-cache key per program: a step passed ``compiler_options`` here missed the
    entry the same program compiled elsewhere had written."""
    return jax.jit(fun, **kwargs)


def make_params(seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s).astype(np.float32) * 0.5)
    return {"layers": [{"weight": f(5, 3), "bias": f(3)}, {"weight": f(3, 2), "bias": f(2)}]}


def make_batch(step, seed=1):
    r = np.random.default_rng(seed * 1000 + step)
    return (jnp.asarray(r.normal(size=(BATCH, 5)).astype(np.float32)),
            jnp.asarray(r.normal(size=(BATCH, 2)).astype(np.float32)))


def loss(params, x, y):
    h = jnp.tanh(x @ params["layers"][0]["weight"] + params["layers"][0]["bias"])
    out = h @ params["layers"][1]["weight"] + params["layers"][1]["bias"]
    return jnp.mean((out - y) ** 2)


def reference(tx, params, num_steps):
    """The unsharded transform on the full-batch gradient: what every sharded run must equal."""
    state = tx.init(params)

    @jitted
    def step(params, state, x, y):
        g = jax.grad(loss)(params, x, y)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    history = []
    for i in range(num_steps):
        params, state = step(params, state, *make_batch(i))
        history.append(params)
    return history


def shard_map_train(tx, mesh, params, *, jit=True, donate_state=False):
    """``(init, step)`` of a data-parallel training loop of ``tx`` over ``mesh``'s axis ``"dp"``.

    As users write it: ``local_grad`` per device, state specs from ``hybrid.jax.state_specs``,
    params replicated, the batch split over ``"dp"``, default ``check_vma``. ``donate_state``
    donates the state to the jitted step (persistent buckets are then filled in place).
    """
    specs = hj.state_specs(tx, params, "dp", axis_size=mesh.size)

    def step(params, state, x, y):
        g = hj.local_grad(loss, "dp")(params, x, y)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("dp"), P("dp")), out_specs=(P(), specs))
    if jit:
        init = jitted(init)
        step = jitted(step, donate_argnums=(1,) if donate_state else ())
    return init, step


def max_abs_diff(got, want) -> float:
    """The largest |got - want| over every leaf of two trees of the same structure."""
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True))


def assert_trees_close(got, want, *, rtol, atol, what=""):
    """Every leaf of ``got`` close to ``want``'s (same structure), the failing leaf named."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")
