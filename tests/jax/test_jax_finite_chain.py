"""``hybrid.jax.apply_if_finite`` around the chain users write (optax's global-norm clip, a masked
AdamW) inside ``zero``: ``zero`` looks through hybrid's skip as through a chain (the clip becomes
its axis-aware twin, the mask is laid out per element), against unsharded ``optax.apply_if_finite``
with a NaN batch in the middle of the run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import hybrid.jax as hj
from _jax_model import CAPS, assert_trees_close, jitted, loss, make_batch, make_params, shard_map_train

# test_jax_zero.py's tolerance: float32, a mean of per-device means against one mean
RTOL, ATOL = 1e-6, 2e-7
DECAY = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)


def _chain():
    return optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1, mask=DECAY))


def _batch(i):
    x, y = make_batch(i)
    return (x.at[0, 0].set(jnp.nan), y) if i == 2 else (x, y)  # one NaN: the step is skipped


@functools.cache
def _reference():
    """Unsharded optax.apply_if_finite around the same chain, jitted: its parameters and
    state after each of the 5 steps (both stages' oracle, computed once)."""
    ref_tx = optax.apply_if_finite(_chain(), 3)

    @jitted
    def step(ref, ref_state, x, y):
        u, ref_state = ref_tx.update(jax.grad(loss)(ref, x, y), ref_state, ref)
        return optax.apply_updates(ref, u), ref_state

    ref, ref_state, history = make_params(), ref_tx.init(make_params()), []
    for i in range(5):
        ref, ref_state = step(ref, ref_state, *_batch(i))
        history.append((ref, ref_state))
    return history


@pytest.mark.parametrize("stage", [1, 2])
def test_skip_around_the_natural_chain_equals_optax(stage):
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    tx = hj.zero(hj.apply_if_finite(_chain(), 3, "dp"), "dp", stage=stage, **CAPS)
    params = make_params()
    init, step = shard_map_train(tx, mesh, params)
    state = init(params)
    for i, (ref, ref_state) in enumerate(_reference()):
        params, state = step(params, state, *_batch(i))
        assert_trees_close(params, ref, rtol=RTOL, atol=ATOL, what=f"step {i}")
    assert int(state.inner.total_notfinite) == int(ref_state.total_notfinite) == 1
