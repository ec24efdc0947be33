"""hybrid.jax.clip_by_global_norm in both placements, against optax.clip_by_global_norm unsharded.

Before, the clip summed squared norms over the axis whatever it was given: after
bucketed_all_reduce (gradients identical on every device) it counted each element world_size
times, so it clipped too hard (SGD parameters 5.7e-2 off after 30 steps on 4 devices).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
from _jax_model import CAPS, make_batch, make_params, max_abs_diff, reference, shard_map_train

NUM_STEPS, WORLD, MAX_NORM = 30, 4, 0.1  # the gradients' norm is ~1: the clip acts on every step
# float32, same framework: a mean of per-device means vs one mean over the batch, and the norm's
# squares summed in another order: a few ulps per step, as in test_jax_zero.
RTOL, ATOL = 1e-6, 2e-7
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
PLACEMENTS = {
    "after_bucketed_all_reduce": lambda opt: optax.chain(hj.bucketed_all_reduce("dp", **CAPS),
                                                         hj.clip_by_global_norm(MAX_NORM, "dp"), opt),
    "inside_zero": lambda opt: hj.zero(optax.chain(hj.clip_by_global_norm(MAX_NORM, "dp"), opt), "dp", **CAPS),
}


@functools.cache
def reference_history(opt):
    return reference(optax.chain(optax.clip_by_global_norm(MAX_NORM), OPTIMIZERS[opt]()), make_params(), NUM_STEPS)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_clip_equals_optax_unsharded(placement, opt):
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("dp",))
    tx = PLACEMENTS[placement](OPTIMIZERS[opt]())
    params = make_params()
    init, step = shard_map_train(tx, mesh, params)
    state = init(params)
    for i, want in enumerate(reference_history(opt)):
        params, state = step(params, state, *make_batch(i))
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL, err_msg=f"step {i}")
    print(f"clip {placement}, {opt}: max |param diff| after {NUM_STEPS} steps against optax unsharded "
          f"{max_abs_diff(params, want):.1e}")


def test_sharded_and_replicated_leaves_in_one_tree():
    # A leaf split over the axis counts once in all, a replicated one once: the norm of the whole.
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("dp",))
    tx = hj.clip_by_global_norm(1.0, "dp")
    tree = {"split": jnp.arange(8.0), "whole": jnp.full(3, 2.0)}
    got = jax.jit(jax.shard_map(lambda u: tx.update(u, tx.init(u))[0], mesh=mesh,
                                in_specs=({"split": P("dp"), "whole": P()},),
                                out_specs={"split": P("dp"), "whole": P()}))(tree)
    want, _ = optax.clip_by_global_norm(1.0).update(tree, optax.EmptyState())
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1.3e-6, atol=0)


@pytest.mark.parametrize("where", ["pmap", "check_vma_false"])
def test_refused_where_it_cannot_tell(where):
    # Outside zero, with no variance tracked, shards and replicated updates look alike.
    tx = optax.chain(hj.bucketed_all_reduce("dp"), hj.clip_by_global_norm(1.0, "dp"))
    run = lambda g: tx.update(g, tx.init(g))[0]
    g = jnp.ones((WORLD, 3))
    with pytest.raises(ValueError, match=r"cannot tell whether the updates are shards or replicated over 'dp'"
                                         r".*use optax.clip_by_global_norm there"):
        if where == "pmap":
            jax.pmap(run, axis_name="dp")(g)
        else:
            mesh = Mesh(np.array(jax.devices()[:WORLD]), ("dp",))
            jax.shard_map(run, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=False)(g.ravel())
