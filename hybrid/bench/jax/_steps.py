"""The jitted train steps that ``bench jax`` times, and how it times them: shared by its MLP parts
(host devices) and its GPT part (``--device``, ``hybrid.bench.gpt``).

Every step is a ``jax.shard_map`` over a one-axis mesh ``"dp"``: forward, this device's gradient,
the variant's reduction and optimizer, apply; params and state donated, as a training loop does.
"""

from __future__ import annotations

import statistics
import time

from hybrid.bench._stats import rotated


def pmean_tree(axis):
    """The baseline DDP-style reduction: one ``pmean`` per leaf, as plain optax code writes it."""
    import jax
    import optax

    def update(u, s, p=None):
        del p
        return jax.lax.pmean(u, axis), s
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def bytes_per_device(state, device) -> int:
    """Bytes of the arrays of ``state`` held on ``device`` (its shards of them)."""
    import jax
    return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(state) for s in x.addressable_shards
               if s.device == device)


def step_plan_bytes(compiled) -> int | None:
    """What XLA planned for one device at the compiled step's peak: its arguments, its outputs not
    aliased to (donated) arguments, and its temporaries; ``None`` where the backend gives no plan."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)


def run_interleaved(steps: dict, states: dict, x, reps: int, num_steps: int, order, *,
                    warmup: int = 0) -> tuple[dict, dict]:
    """Wall-clock and process CPU seconds per step of every name in ``order``, one entry per repetition.

    ``order`` is the round: variant names, a name with a ``'`` being its variant again (the A/A
    reference, on the same compiled step and state). CPU time (all threads of this process) is
    printed beside wall time because on a shared machine other jobs' load stretches wall time, by
    a different amount in every repetition. ``warmup`` rounds run first and are not kept. Each
    repetition ends in ``jax.block_until_ready``: on a GPU the time is the device's, to the end.
    """
    import jax
    wall = {name: [] for name in order}
    cpu = {name: [] for name in order}
    for rep in range(warmup + reps):
        for name in rotated(order, rep):  # interleaved: every repetition times every variant once
            key = name.rstrip("'")
            p, s = states[key]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(num_steps):
                p, s = steps[key](p, s, x)
            jax.block_until_ready((p, s))
            if rep >= warmup:
                wall[name].append((time.perf_counter() - t0) / num_steps)
                cpu[name].append((time.process_time() - c0) / num_steps)
            states[key] = (p, s)
    return wall, cpu


def print_times(wall: dict, cpu: dict, out=print) -> tuple[dict, dict]:
    med = {name: statistics.median(t) for name, t in wall.items()}
    cpu_med = {name: statistics.median(t) for name, t in cpu.items()}
    for name in wall:
        out(f"  {name:22s} {med[name] * 1e3:9.2f} ms/step  (min {min(wall[name]) * 1e3:.2f}, "
            f"max {max(wall[name]) * 1e3:.2f}); CPU {cpu_med[name] * 1e3:.2f} ms/step")
    return med, cpu_med


def compile_steps(variants: dict, params, x, mesh, loss):
    """One compiled shard_map train step and an initial (params, state) per variant.

    ``variants`` maps a name to ``(transform, reduces)``: ``reduces`` False for a step without a
    collective (the compute floor). ``loss(params, x)`` is this device's loss on its rows of ``x``.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import hybrid.jax as hj
    steps, states = {}, {}
    for name, (tx, reduce) in variants.items():
        specs = hj.state_specs(tx, params, "dp", axis_size=mesh.size)

        def step(params, state, x, tx=tx):
            g = hj.local_grad(loss, "dp")(params, x)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state

        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
        # Without a reduction (the compute floor) the parameters differ per device: check_vma off
        # lets out_specs P() keep one device's copy, which is all a timing needs.
        # Params and state donated, as a training loop does: every variant updates in place.
        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("dp")), out_specs=(P(), specs),
                                   check_vma=reduce), donate_argnums=(0, 1))
        own = jax.tree_util.tree_map(jnp.copy, params)  # each variant donates its own copy
        state = init(own)
        steps[name] = fn.lower(own, state, x).compile()
        states[name] = jax.block_until_ready(steps[name](own, state, x))  # warm up
    return steps, states


def compile_zero3(tx, params, x, mesh, loss, *, copy_backend: str | None = None):
    """Stage 3's compiled step (``jax.grad`` of the gathered loss on ParamShards) and its first
    (shards, state), as :func:`compile_steps` makes them for the other variants."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import hybrid.jax as hj
    shards = jax.jit(jax.shard_map(lambda p: hj.shard_params(p, "dp", copy_backend=copy_backend), mesh=mesh,
                                   in_specs=P(), out_specs=P("dp")))(params)
    specs = hj.state_specs(tx, shards, "dp", axis_size=mesh.size)
    loss_of_shards = hj.gathered(loss)

    def step(shards, state, x):
        u, state = tx.update(jax.grad(loss_of_shards)(shards, x), state, shards)
        return optax.apply_updates(shards, u), state

    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("dp"), out_specs=specs))(shards)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), specs, P("dp")), out_specs=(P("dp"), specs)),
                 donate_argnums=(0, 1))
    compiled = fn.lower(shards, state, x).compile()
    return compiled, jax.block_until_ready(compiled(shards, state, x))
