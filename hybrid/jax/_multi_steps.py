"""Gradient accumulation that reduces once per ``k`` micro-steps: :class:`MultiSteps`.

``optax.MultiSteps(tx, k)`` calls ``tx.update`` on *every* micro-step and keeps its result only on
the k-th (``jnp.where`` over the new and the old state): unsharded that is wasted arithmetic, but
around ``hybrid.jax.zero`` or ``bucketed_all_reduce`` it is a reduce-scatter and an all-gather of
every bucket on every micro-step, whose results are thrown away. torch's answer is ``no_sync()``:
accumulate this rank's own gradients and communicate on the last micro-step only.

:class:`MultiSteps` here is ``optax.MultiSteps`` (same arguments, same ``MultiStepsState``, same
numbers) whose inner update runs under ``lax.cond`` on the k-th micro-step alone, so the
collectives inside the inner transform run once per ``k`` micro-steps. The accumulator holds this
device's own gradient mean (the whole gradient per device, as torch's ``.grad`` under
``no_sync``); ``hybrid.jax.state_specs`` gives it ``P(axis)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax



class MultiSteps(optax.MultiSteps):
    """``optax.MultiSteps`` that runs the inner transform only on the k-th micro-step (``no_sync``).

    Takes optax's arguments (``opt``, ``every_k_schedule``, ``use_grad_mean``,
    ``should_skip_update_fn``, ``accumulator_dtype``) and keeps its state; the updates and states
    equal optax's. Wrap ``hybrid.jax.zero(...)`` (any stage) or a chain after
    ``bucketed_all_reduce``: their collectives then run once per ``k`` micro-steps, not on each.

    >>> import jax, jax.numpy as jnp, optax
    >>> tx = MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> u1, state = tx.update(jnp.array([1.0, 2.0]), state, params)   # accumulated, nothing applied
    >>> u2, state = tx.update(jnp.array([3.0, 4.0]), state, params)   # the mean of both, applied
    >>> u1.tolist(), u2.tolist()
    ([0.0, 0.0], [-2.0, -3.0])
    """

    def update(self, updates, state: optax.MultiStepsState, params=None, **extra_args):
        k_steps = self._every_k_schedule(state.gradient_step)
        skip, skip_state = self._should_skip_update_fn(updates, state.gradient_step, params)
        if (skip.dtype, skip.shape) != (jnp.bool_, ()):
            raise ValueError(f"MultiSteps: should_skip_update_fn must return a boolean scalar, got "
                             f"{skip.dtype}{list(skip.shape)}")
        acc_grads = jax.tree.map(lambda g, acc: self._acc_update(g, acc, n_acc=state.mini_step), updates,
                                 state.acc_grads)
        emit = jnp.logical_and(jnp.logical_not(skip), state.mini_step == k_steps - 1)
        grads = optax.tree.cast_like(acc_grads, updates)
        shapes = jax.eval_shape(lambda g, s, p: self._opt.update(g, s, params=p, **extra_args),
                                grads, state.inner_opt_state, params)

        def step(grads, inner_state, params):  # the k-th micro-step: the inner transform, its collectives
            return self._opt.update(grads, inner_state, params=params, **extra_args)

        def hold(grads, inner_state, params):  # the others: no update, no collective
            del grads, params
            return _zeros_like(shapes[0]), inner_state

        final, inner_state = jax.lax.cond(emit, step, hold, grads, state.inner_opt_state, params)
        kept = jnp.logical_not(skip)
        new_state = optax.MultiStepsState(
            mini_step=jnp.where(kept, optax.safe_increment(state.mini_step) % k_steps, state.mini_step),
            gradient_step=jnp.where(emit, optax.safe_increment(state.gradient_step), state.gradient_step),
            inner_opt_state=inner_state,
            acc_grads=jax.tree.map(
                lambda new, old: jnp.where(kept, jnp.where(emit, jnp.zeros_like(new), new), old).astype(
                    self._accumulator_dtype), acc_grads, state.acc_grads),
            skip_state=skip_state)
        return final, new_state


def _zeros_like(shapes):
    """Zeros of the inner update's shapes, varying over the axes its updates vary over (a
    ``lax.cond``'s branches must agree on that inside ``shard_map``)."""
    def zeros(s):
        z = jnp.zeros(s.shape, s.dtype)
        manual = getattr(s, "manual_axis_type", None)  # a ShapeDtypeStruct's (JAX 0.10), else older JAX's vma
        axes = tuple(sorted(manual.varying if manual is not None else getattr(s, "vma", ())))
        return jax.lax.pcast(z, axes, to="varying") if axes else z
    return jax.tree.map(zeros, shapes)
