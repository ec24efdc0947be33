"""One process of the 2-process test: zero stage 2, then bucketed_all_reduce, over a mesh spanning both processes."""

import os
import sys

from tests._xla import host_flags  # imports nothing; ROOT is on PYTHONPATH

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = host_flags(int(sys.argv[3]))  # compiled as the test process compiles
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[1]}", num_processes=2,
                           process_id=int(sys.argv[2]), initialization_timeout=60)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import hybrid.jax as hj  # noqa: E402
from _jax_model import CAPS, make_batch, make_params, reference, shard_map_train  # noqa: E402

NUM_STEPS = int(sys.argv[4])


def train(tx, reference_tx, what: str, mesh):
    """NUM_STEPS jitted steps of ``tx`` on the global mesh, checked against ``reference_tx`` on the full batch."""
    n = mesh.size

    def global_array(x, spec):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])

    params0 = make_params()
    params = jax.tree_util.tree_map(lambda x: global_array(x, P()), params0)
    init, step = shard_map_train(tx, mesh, params0, donate_state=True)
    state = init(params)
    ref = reference(reference_tx, params0, NUM_STEPS)
    for i in range(NUM_STEPS):
        x, y = make_batch(i)
        params, state = step(params, state, global_array(x, P("dp")), global_array(y, P("dp")))
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref[i])):
            # as in test_jax_zero: a few ulps per step from the order of the batch-mean sums
            np.testing.assert_allclose(np.asarray(a.addressable_data(0)), np.asarray(b), rtol=1e-6, atol=2e-7)
    local_state = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(state) if x.ndim
                      for s in x.addressable_shards)
    print(f"process {jax.process_index()}: {what}: {n} devices, {len(jax.local_devices())} local, "
          f"{NUM_STEPS} steps equal the reference; local state bytes {local_state}", flush=True)


def main():
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    make_inner = lambda clip: optax.chain(clip, optax.adamw(1e-2, weight_decay=0.1))
    train(hj.zero(make_inner(hj.clip_by_global_norm(0.1, "dp")), "dp", stage=2, **CAPS),
          make_inner(optax.clip_by_global_norm(0.1)), "zero stage 2", mesh)
    momentum = lambda: optax.sgd(0.05, momentum=0.9)
    train(optax.chain(hj.bucketed_all_reduce("dp", **CAPS), momentum()), momentum(), "bucketed_all_reduce", mesh)


main()
jax.distributed.shutdown()
