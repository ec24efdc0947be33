"""One plan at torch's default caps (issue 24.1): the flax half of the GPT pair, planned by
hybrid.jax from its own backward's gradient-ready order through the declared mapping, holds
exactly the buckets torch's own DistributedDataParallel holds after its rebuild.

The oracle is torch's DDP itself (a comm hook reads each bucket's parameters and flat buffer in
the second iteration, after the rebuild). The JAX side never sees torch's plan: it reads the
order from the jaxpr of ``jax.grad`` (hybrid.jax.gradient_ready_order), maps it with the pairing
(ParamPairing.torch_ready_order) and rebuilds at torch's default caps. Compared: bucket
membership and order, the plan's fingerprint against hybrid's torch DDP's, and every packed
bucket bitwise (the same gradients, torch's in torch's layout, JAX's in flax's, packed by each).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hybrid.jax as hj
from hybrid.core import BucketPlan, TensorSpec, plan_buckets, rebuild_plan, shard_flat
from hybrid.jax._copy import pack_bucket
from hybrid.jax._specs import _Layout
from hybrid.models import GPT_MAPPING, FlaxGPT, GPTConfig, TorchGPT, flax_loss
from hybrid.parity._bridge import jax_tree, pair_models
from tests.parity._torch_plan import torch_buckets

CONFIG = GPTConfig()  # ~0.94M parameters: 3.6 MiB of float32 gradients, a 1 MiB first bucket and one more
BATCH = np.random.default_rng(0).integers(0, CONFIG.vocab_size, size=(4, 32))


@pytest.fixture(scope="module")
def torch_side():
    """torch's own DDP on a 1-rank gloo group in this process (tests/parity/_torch_plan.py): the
    buckets, buffers and gradients it reads do not depend on a fresh interpreter, which cost more
    than the run."""
    return torch_buckets(CONFIG, BATCH)


@pytest.fixture(scope="module")
def jax_side(torch_side):
    model = FlaxGPT(CONFIG)
    # the tree's structure only: its values are torch's initial weights, below
    like = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    torch_model = TorchGPT(CONFIG)  # names and shapes only, for the pairing
    pairing = pair_models(torch_model, like, GPT_MAPPING)
    params = jax_tree(like, pairing.to_jax(torch_side["params"]))  # torch's initial weights
    x = jnp.asarray(BATCH)
    ready = hj.gradient_ready_order(lambda p: flax_loss(model, p, x, x), params)
    layout = _Layout.of(params, what="test", order=None, bucket_cap_bytes=25 << 20,
                        first_bucket_cap_bytes=1 << 20, ready_order=ready, pairing=pairing)
    return dict(pairing=pairing, params=params, layout=layout, model=model, ready=ready)


def test_buckets_hold_many_tensors_in_torchs_order(torch_side, jax_side):
    plan = jax_side["layout"].plan
    torch_members = [names for names, _ in torch_side["buckets"]]
    jax_members = [[plan.specs[m].name for m in b.members] for b in plan.buckets]
    assert jax_members == torch_members
    assert [len(m) for m in jax_members] == [16, 36]  # at torch's default caps, on 52 tensors


def test_fingerprint_equals_torch_ddps_rebuilt_plan(torch_side, jax_side):
    # hybrid's torch DDP reproduces torch's rebuild (tests/torch): its plan over torch's specs in
    # torch's ready order is what the JAX side must equal, fingerprint and all
    specs = [TensorSpec(n, a.shape, "float32") for n, a in torch_side["params"].items()]
    index = {s.name: i for i, s in enumerate(specs)}
    ready = [index[n] for names, _ in torch_side["buckets"] for n in names]
    torch_plan = rebuild_plan(plan_buckets(specs), ready, size_limits=(1 << 20, 25 << 20))
    plan = jax_side["layout"].plan
    assert plan == torch_plan and plan.fingerprint() == torch_plan.fingerprint()
    assert BucketPlan.from_json(plan.dumps()).fingerprint() == torch_plan.fingerprint()
    for world in (2, 3):  # and so the ZeRO slices: shard_flat of one plan
        assert shard_flat(plan, world).fingerprint() == shard_flat(torch_plan, world).fingerprint()


def test_packed_buckets_are_torchs_bitwise(torch_side, jax_side):
    layout, pairing = jax_side["layout"], jax_side["pairing"]
    grads = jax_tree(jax_side["params"], pairing.to_jax(torch_side["grads"]))  # torch's gradients, flax's layout
    arrays = layout.spec_arrays(grads)
    for b, (_, torch_flat) in enumerate(torch_side["buckets"]):
        flat = np.asarray(pack_bucket(layout.plan, b, arrays, cuda=False))
        assert flat.shape == torch_flat.shape
        assert flat.tobytes() == torch_flat.tobytes(), f"bucket {b} differs"


def test_zero_steps_through_torchs_plan_like_plain_optax(jax_side):
    # the pairing changes where leaves sit in the buckets, not the update: zero over 2 devices
    # with torch's plan gives optax's adamw on the reduced gradient (float32, reduction order only)
    # jitted, each one program: op by op, the GPT's backward and optax's update compiled a kernel per op
    params, model = jax_side["params"], jax_side["model"]
    x = jnp.asarray(BATCH)
    grads = jax.jit(jax.grad(lambda p: flax_loss(model, p, x, x)))(params)
    tx = hj.zero(optax.adamw(1e-3, weight_decay=0.1), "dp", ready_order=jax_side["ready"], pairing=jax_side["pairing"])
    per_device = jax.tree_util.tree_map(lambda g: jnp.stack([g, g]), grads)
    out = jax.pmap(lambda g: tx.update(g, tx.init(params), params)[0], axis_name="dp")(per_device)
    adamw = optax.adamw(1e-3, weight_decay=0.1)
    want = jax.jit(lambda g, p: adamw.update(g, adamw.init(p), p)[0])(grads, params)
    for got, ref in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref), rtol=1.3e-6, atol=5e-7)
