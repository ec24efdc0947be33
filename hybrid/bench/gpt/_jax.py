"""GPT training steps of ``hybrid.jax.zero`` stages 1-3 against plain, unsharded optax, on one mesh
of JAX devices (``bench jax --device D``).

The flax half of the model pair (``hybrid.models.FlaxGPT``), AdamW. Variants, each a jitted
``shard_map`` train step over axis ``"dp"`` with params and state donated (``hybrid.bench.jax._steps``):

- ``unsharded_adamw``: ``optax.chain(pmean per leaf, optax.adamw)``, the reference, timed twice
  per round (``unsharded_adamw'``, the A/A);
- ``zero1_adamw`` / ``zero2_adamw``: ``hybrid.jax.zero(optax.adamw(...), "dp", stage=1 / 2)``;
- ``zero3_adamw``: stage 3 on ``ParamShards`` (``shard_params``), the loss ``gathered``.

The bucket copies go through the CUDA kernels (XLA FFI) where the library is built and JAX's
default backend is a GPU (``copy_backend``, as ``hybrid.kernels`` decides), else through ``jnp``.
bf16: the parameters cast to bfloat16 inside the loss (the forward and its backward in bfloat16,
the logits back to float32 for the loss, as autocast does); gradients, master parameters and
AdamW's state stay float32. Memory per device: ``held`` (params and state between steps,
measured) and ``peak``, XLA's plan of the compiled step (``memory_analysis``: arguments, outputs
not donated, temporaries), the one per-variant figure JAX offers (its device peak cannot be reset).
"""

from __future__ import annotations

from hybrid.bench.jax import _steps
from hybrid.bench.gpt._config import LR, StepBench

REFERENCE = "unsharded_adamw"
PAIRS = tuple((f"zero{stage}_adamw", REFERENCE) for stage in (1, 2, 3))
ORDER = [REFERENCE, "zero1_adamw", REFERENCE + "'", "zero2_adamw", "zero3_adamw"]


def loss_of(model, dtype: str):
    """``loss(params, (idx, targets))``: mean next-token cross-entropy, in float32 or bf16 (above)."""
    import jax
    import jax.numpy as jnp
    import optax

    def loss(params, batch):
        idx, targets = batch
        if dtype == "bf16":
            params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
        logits = model.apply({"params": params}, idx).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss


def measure(bench: StepBench, devices, *, copy_backend: str | None = None, on_dtype=None) -> dict:
    """Every variant's interleaved step times and memory, per dtype: ``{"dtypes": {...}}`` as
    ``hybrid.bench.gpt._report`` reads it. ``on_dtype(dtype, result)`` runs after each dtype, so a
    run cut short keeps what it measured."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from hybrid.models import FlaxGPT

    mesh = Mesh(np.array(devices), ("dp",))
    model = FlaxGPT(bench.gpt)
    rows = bench.batch * len(devices)  # the global batch: bench.batch rows per device
    tokens = np.random.default_rng(0).integers(0, bench.gpt.vocab_size, (rows, bench.seq + 1), dtype=np.int32)
    batch = (jax.numpy.asarray(tokens[:, :-1]), jax.numpy.asarray(tokens[:, 1:]))
    params = jax.jit(model.init)(jax.random.key(0), batch[0][:1])["params"]
    result = {"dtypes": {}}
    for dtype in bench.dtypes:
        steps, states, failed = _compile_variants(params, batch, mesh, loss_of(model, dtype), copy_backend)
        # without its reference no variant has anything to be timed against
        order = [] if REFERENCE in failed else [name for name in ORDER if name.rstrip("'") in steps]
        wall, cpu = _steps.run_interleaved(steps, states, batch, bench.reps, 1, order, warmup=bench.warmup)
        memory = {name: {"held": _steps.bytes_per_device(states[name], devices[0]),
                         "peak": _steps.step_plan_bytes(steps[name])} for name in steps}
        result["dtypes"][dtype] = {"times": wall, "cpu": cpu, "memory": memory, "failed": failed}
        del steps, states
        if on_dtype is not None:
            on_dtype(dtype, result)
    return result


def _compile_variants(params, batch, mesh, loss, copy_backend):
    """Every variant's compiled step and first state, and the error of each that failed to compile
    or take its first step: on a lent GPU one broken variant must not cost the others' figures."""
    import optax

    import hybrid.jax as hj
    adamw = lambda: optax.adamw(LR)  # noqa: E731 (a fresh transform per variant)
    compilers = {REFERENCE: lambda: _steps.compile_steps(
        {REFERENCE: (optax.chain(_steps.pmean_tree("dp"), adamw()), True)}, params, batch, mesh, loss)}
    for stage in (1, 2):
        name = f"zero{stage}_adamw"
        compilers[name] = lambda name=name, stage=stage: _steps.compile_steps(
            {name: (hj.zero(adamw(), "dp", stage=stage, copy_backend=copy_backend), True)}, params, batch, mesh, loss)

    def zero3():
        step, state = _steps.compile_zero3(hj.zero(adamw(), "dp", stage=3), params, batch, mesh, loss,
                                               copy_backend=copy_backend)
        return {"zero3_adamw": step}, {"zero3_adamw": state}

    compilers["zero3_adamw"] = zero3
    steps, states, failed = {}, {}, {}
    for name, compile_one in compilers.items():
        try:
            one_step, one_state = compile_one()
        except Exception as e:  # noqa: BLE001 (reported in the table, the run goes on)
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        steps.update(one_step)
        states.update(one_state)
    return steps, states, failed


def environment(devices, copy_backend: str | None) -> dict:
    """The software and the copy path the times come from, for the report's header."""
    import jax

    from hybrid import kernels
    return {"jax": jax.__version__, "devices": f"{len(devices)} x {devices[0].device_kind}",
            "copies": "CUDA kernels (XLA FFI)" if kernels.resolve_jax_backend(copy_backend) == "cuda"
            else "jnp (reference)", "matmul precision": jax.config.jax_default_matmul_precision or "default"}
