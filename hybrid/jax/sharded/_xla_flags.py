"""XLA:CPU flags that make a stage-3 step hold what ZeRO-3 promises: ``use_memory_first_xla_cpu``;
and what hybrid does itself on XLA:CPU whatever the flags (``split_bucket``, ``cse_merges_regathers``).

By default XLA:CPU compiles a stage-3 step that gathers every bucket at its start and keeps the
gathered parameters to the backward (docs/jax-zero.md, "ZeRO-3"): the step's temporaries are the
whole model and more, whatever the device count (twice the model before :func:`split_bucket`).
Two flags change that:

- ``--xla_cpu_enable_concurrency_optimized_scheduler=false``: XLA:CPU's memory-minimising
  scheduler instead, which runs each layer's gather, use and gradient close together;
- ``--xla_disable_hlo_passes=cse``: no common-subexpression elimination, which otherwise merges
  the backward's all-gathers (``gathered(..., reshard_after_forward=True)``) with the forward's
  identical ones, so the gathered parameters would live from the forward to the backward.

Measured on the budget bench's 12 x Linear(1024, 1024) at 3 host devices: the step's temporaries
go from 96.2 to 24.3 MiB and the init's from 18.7 to 4.0 MiB, and on this 2-core VM the step got
faster, not slower. They are process-wide (XLA reads ``XLA_FLAGS`` when JAX starts its backend),
so they are the user's choice, not set by ``import hybrid.jax``.
"""

from __future__ import annotations

import os

MEMORY_FIRST_XLA_CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",
                              "--xla_disable_hlo_passes=cse")


def use_memory_first_xla_cpu() -> str:
    """Add :data:`MEMORY_FIRST_XLA_CPU_FLAGS` to ``XLA_FLAGS`` (each once) and return the result.
    Call it before JAX's first computation; after it, the flags would be ignored, so it raises.

    >>> import subprocess, sys
    >>> code = ("import hybrid.jax, os; hybrid.jax.use_memory_first_xla_cpu(); "
    ...         "print(os.environ['XLA_FLAGS'].split()[-1])")
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    '--xla_disable_hlo_passes=cse\\n'
    """
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("use_memory_first_xla_cpu: JAX's backend has started (a computation ran), so XLA has "
                           "read XLA_FLAGS already; call it first thing, before any jax computation")
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags += [f for f in MEMORY_FIRST_XLA_CPU_FLAGS if f not in flags]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    return os.environ["XLA_FLAGS"]


def on_xla_cpu() -> bool:
    """Whether jax computes on XLA:CPU (its default backend): the compiler whose passes the two
    helpers below work around."""
    import jax
    return jax.default_backend() == "cpu"


def cse_merges_regathers() -> bool:
    """Whether XLA merges a stage-3 backward's all-gathers with the forward's identical ones: on
    XLA:CPU unless ``XLA_FLAGS`` disables its ``cse`` pass (:func:`use_memory_first_xla_cpu`).
    XLA:CPU drops JAX's optimization barriers before CSE runs, so ``jax.checkpoint`` cannot keep
    them apart there; other backends keep the barriers (and the regathers)."""
    if not on_xla_cpu():
        return False
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_disable_hlo_passes=") and "cse" in flag.split("=", 1)[1].split(","):
            return False
    return True


def split_bucket(full, sizes, axis_name) -> tuple:
    """``jax.lax.split(full, sizes)`` of a gathered bucket; on XLA:CPU inside a conditional.

    XLA:CPU fuses a slice into its consumers (a bias into its add), so the whole gathered bucket
    would stay live for them beside the copies its dots need (a dot reads a buffer of its own): the
    model twice. A conditional's outputs are buffers of their own, so the bucket dies once split
    (8 x Linear(512), 4 host devices: a stage-3 step's temporaries 15.05 -> 10.20 MiB, 4.79 -> 4.04
    under :func:`use_memory_first_xla_cpu`). Both branches are the same split; the predicate
    (``axis_index == 0``) is one XLA cannot fold. Its transpose (the backward) is the same
    conditional of a concatenate, which packs the gradients as the split's would.
    """
    import jax

    def split(flat):
        return tuple(jax.lax.split(flat, sizes))

    if full.shape[0] == 0 or not on_xla_cpu():
        return split(full)
    return jax.lax.cond(jax.lax.axis_index(axis_name) == 0, split, split, full)
