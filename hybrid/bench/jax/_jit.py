"""``python -m hybrid bench jax`` [3] (alone: ``--jit-only``): ZeRO inside a plain ``jax.jit`` against GSPMD's own.

One MLP (``--jit-depth`` x Linear(``--jit-width``), tanh, AdamW), 4 host devices, the batch
sharded ``P("dp")``, every step jitted with params and state donated, timed interleaved
(``hybrid.bench._stats``), each against the replicated step (plain optax, nothing sharded):

- ``gspmd_zero1``: GSPMD's own ZeRO-1, AdamW's state sharded ``P("dp")`` on its first axis, XLA
  choosing the collectives; ``gspmd_fsdp``: the parameters sharded so too (GSPMD's FSDP);
- ``jit_zero1`` / ``jit_zero2`` / ``jit_zero3``: ``hybrid.jax.zero(adamw, "dp", stage=k, mesh=mesh)``
  in the same plain jit step (stage 3 on ``shard_params(..., mesh=mesh)`` and ``gathered(loss)``);
- ``sm_zero2`` / ``sm_zero3``: the ``shard_map`` path (``local_grad``; stage 3 ``gathered``).

Besides the times: each step's compiled temporaries per device (``memory_analysis()``), the bytes
a device holds between steps (params and state), and the collectives in each compiled step.
"""

from __future__ import annotations

import re

from hybrid.bench._stats import Ratio
from hybrid.bench.jax import _steps

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def collectives(text: str) -> dict:
    """How many of each collective a compiled (optimized) HLO module issues (async pairs once)."""
    return {k: len(re.findall(r"\s" + re.escape(k) + r"(?:-start)?\(", text)) for k in COLLECTIVES}


def _mlp(width: int, depth: int, seed: int = 0):
    import jax.numpy as jnp
    import numpy as np
    r = np.random.default_rng(seed)
    return {f"layer{i}": {"weight": jnp.asarray(r.normal(size=(width, width)).astype(np.float32) / np.sqrt(width)),
                          "bias": jnp.zeros(width, jnp.float32)} for i in range(depth)}


def _loss(params, x):
    import jax.numpy as jnp
    h = x
    for i in range(len(params)):
        layer = params[f"layer{i}"]
        h = jnp.tanh(h @ layer["weight"] + layer["bias"])
    return jnp.mean(h * h)


def compile_variants(width: int, depth: int, batch: int, mesh, axis: str = "dp", *, only=None):
    """``(steps, states, x)``: every variant's compiled step ``(params, state, x) -> (params, state)``
    and its first ``(params, state)``, and the sharded batch; ``only``: the names of the variants
    to compile (all when None: the tests compile the two they compare)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import hybrid.jax as hj

    rep, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(axis))
    n = mesh.shape[axis]
    adamw = lambda: optax.adamw(1e-3, weight_decay=0.1)
    x = jax.device_put(jnp.asarray(np.random.default_rng(1).normal(size=(batch, width)).astype(np.float32)), sharded)
    first_axis = lambda a: sharded if a.ndim and a.shape[0] % n == 0 else rep  # GSPMD's: P(axis) on dim 0
    steps, states = {}, {}
    wanted = lambda name: only is None or name in only

    def plain_jit(name, tx, params, state, loss, out_shardings=None):
        def step(p, s, x):
            u, s = tx.update(jax.grad(loss)(p, x), s, p)
            return optax.apply_updates(p, u), s
        jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)
        steps[name] = jitted.lower(params, state, x).compile()
        states[name] = (params, state)

    for name, param_sharding, state_sharding in (("replicated", "rep", "rep"), ("gspmd_zero1", "rep", "first"),
                                                 ("gspmd_fsdp", "first", "first")):
        if not wanted(name):
            continue
        tx = adamw()
        pick = {"rep": lambda a: rep, "first": first_axis}
        params = jax.device_put(_mlp(width, depth), jax.tree.map(pick[param_sharding], _mlp(width, depth)))
        state_sh = jax.tree.map(pick[state_sharding], jax.eval_shape(tx.init, params))
        state = jax.jit(tx.init, out_shardings=state_sh)(params)
        plain_jit(name, tx, params, state, _loss,
                  out_shardings=(jax.tree.map(pick[param_sharding], params), state_sh))
    for stage in (1, 2, 3):
        if not wanted(f"jit_zero{stage}"):
            continue
        tx = hj.zero(adamw(), axis, stage=stage, mesh=mesh)
        if stage == 3:
            params, loss = hj.shard_params(_mlp(width, depth), axis, mesh=mesh), hj.gathered(_loss)
        else:
            params, loss = jax.device_put(_mlp(width, depth), rep), _loss
        plain_jit(f"jit_zero{stage}", tx, params, jax.jit(tx.init)(params), loss)
    for stage in (2, 3):
        if not wanted(f"sm_zero{stage}"):
            continue
        tx = hj.zero(adamw(), axis, stage=stage)
        if stage == 3:
            steps["sm_zero3"], states["sm_zero3"] = _steps.compile_zero3(tx, _mlp(width, depth), x, mesh, _loss)
        else:
            compiled, first = _steps.compile_steps({"sm_zero2": (tx, True)}, _mlp(width, depth), x, mesh, _loss)
            steps.update(compiled)
            states.update(first)
    return steps, states, x


VARIANTS = ("gspmd_zero1", "gspmd_fsdp", "jit_zero1", "jit_zero2", "jit_zero3", "sm_zero2", "sm_zero3")
# Each hybrid step beside the GSPMD step of the same sharding (the goal: at or under it).
AGAINST = {"jit_zero1": "gspmd_zero1", "jit_zero2": "gspmd_zero1", "jit_zero3": "gspmd_fsdp",
           "sm_zero2": "gspmd_zero1", "sm_zero3": "gspmd_fsdp"}


def run(width: int, depth: int, batch: int, reps: int, num_steps: int, mesh, out=print) -> dict:
    """Time and print the variants; returns the ratio-table groups (``hybrid.bench._stats``)."""
    import jax

    steps, states, x = compile_variants(width, depth, batch, mesh)
    order = ["replicated", "replicated'", *VARIANTS]
    dev = jax.devices()[0]
    held = {name: _steps.bytes_per_device(states[name], dev) for name in ("replicated", *VARIANTS)}
    temps = {name: steps[name].memory_analysis().temp_size_in_bytes for name in ("replicated", *VARIANTS)}
    counts = {name: collectives(steps[name].as_text()) for name in ("replicated", *VARIANTS)}
    times, cpu = _steps.run_interleaved(steps, states, x, reps, num_steps, order, warmup=1)
    out(f"[3] ZeRO inside a plain jit: MLP {depth} x Linear({width}), AdamW, global batch {batch} sharded "
        f"P('dp') over 4 host devices, {reps} reps x {num_steps} steps interleaved (after 1 warm-up round)")
    _steps.print_times(times, cpu, out)
    for name in ("replicated", *VARIANTS):
        c = ", ".join(f"{v} {k}" for k, v in counts[name].items() if v)
        out(f"  {name:12s} temporaries {temps[name] / 2**20:6.2f} MiB, params + state held {held[name] / 2**20:6.2f} "
            f"MiB per device; collectives: {c or 'none'}")
    ratios = [Ratio(name, "replicated", times[name], times["replicated"]) for name in VARIANTS]
    ratios += [Ratio(name, ref, times[name], times[ref]) for name, ref in AGAINST.items()]
    return {"[3] jit": (ratios, Ratio("replicated'", "replicated", times["replicated'"], times["replicated"]))}
