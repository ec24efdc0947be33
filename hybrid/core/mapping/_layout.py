"""Layouts: how one tensor is laid out on the JAX side and on the torch side, declared as data.

A :class:`Layout` is a short list of steps that turn the JAX-side array into the torch-side one:
``("transpose", axes)`` and ``("reshape", shape)``. Both are permutations or re-viewings of the
same elements, so the way back is exact (bitwise): transposes by the inverse permutation,
reshapes back to the shape the step started from, which the JAX-side shape determines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

_KINDS = ("transpose", "reshape")


def _permute(x, axes: tuple[int, ...]):
    # torch tensors spell a transpose over all axes ``permute``; numpy and jax arrays ``transpose``.
    return x.permute(*axes) if hasattr(x, "permute") else x.transpose(axes)


def _reshaped(shape: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...]:
    """``target`` with its -1 resolved for an array of ``shape``, or ValueError."""
    size, known = math.prod(shape), math.prod(d for d in target if d != -1)
    out = tuple(size // known if d == -1 and known else d for d in target)
    if math.prod(out) != size:
        raise ValueError(f"cannot reshape {shape} to {target}")
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """The steps from the JAX-side array to the torch-side array; ``Layout()`` keeps it as it is.

    Args:
      steps: ``("transpose", axes)`` (a permutation of the axes, as ``numpy.transpose``) or
        ``("reshape", shape)`` (one -1 allowed), applied in order.

    >>> import numpy as np
    >>> dense = Layout.transpose(1, 0)                    # flax Dense (in, out) -> nn.Linear (out, in)
    >>> dense.torch_shape((3, 5))
    (5, 3)
    >>> k = np.arange(15.0).reshape(3, 5)
    >>> np.array_equal(dense.to_jax(dense.to_torch(k), (3, 5)), k)
    True
    >>> str(Layout.transpose(2, 0, 1).then(Layout.reshape(-1, 4)))
    'transpose(2, 0, 1) then reshape(-1, 4)'
    """

    steps: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self):
        steps = []
        for step in self.steps:
            if not (isinstance(step, (tuple, list)) and len(step) == 2 and step[0] in _KINDS):
                raise ValueError(f"a layout step is ('transpose', axes) or ('reshape', shape), got {step!r}")
            kind, values = step[0], tuple(step[1])
            if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
                raise ValueError(f"{kind} takes ints, got {values!r}")
            if kind == "transpose" and sorted(values) != list(range(len(values))):
                raise ValueError(f"transpose axes must be a permutation of 0..{len(values) - 1}, got {values!r}")
            if kind == "reshape" and (values.count(-1) > 1 or any(v < -1 for v in values)):
                raise ValueError(f"reshape takes sizes >= 0 and at most one -1, got {values!r}")
            steps.append((kind, values))
        object.__setattr__(self, "steps", tuple(steps))

    @classmethod
    def transpose(cls, *axes: int) -> "Layout":
        """The torch array is the JAX array transposed by ``axes`` (``numpy.transpose``'s meaning)."""
        return cls((("transpose", axes),))

    @classmethod
    def reshape(cls, *shape: int) -> "Layout":
        """The torch array is the JAX array reshaped (row-major, as numpy) to ``shape``."""
        return cls((("reshape", shape),))

    def then(self, other: "Layout") -> "Layout":
        """This layout's steps followed by ``other``'s."""
        return Layout(self.steps + other.steps)

    def _shapes(self, jax_shape: Sequence[int]) -> list[tuple[int, ...]]:
        """The shape before each step and, last, the torch-side shape."""
        shapes = [tuple(int(d) for d in jax_shape)]
        for kind, values in self.steps:
            shape = shapes[-1]
            if kind == "transpose":
                if len(values) != len(shape):
                    raise ValueError(f"transpose{values} needs a {len(values)}-d array, got shape {shape}")
                shapes.append(tuple(shape[a] for a in values))
            else:
                shapes.append(_reshaped(shape, values))
        return shapes

    def torch_shape(self, jax_shape: Sequence[int]) -> tuple[int, ...]:
        """The torch-side shape of a JAX-side array of ``jax_shape``; ValueError if the steps do not fit."""
        return self._shapes(jax_shape)[-1]

    def to_torch(self, x):
        """The torch-side array of the JAX-side array ``x`` (numpy, jax or torch; a view where possible)."""
        shapes = self._shapes(x.shape)
        for (kind, values), before in zip(self.steps, shapes):
            x = _permute(x, values) if kind == "transpose" else x.reshape(_reshaped(before, values))
        return x

    def to_jax(self, y, jax_shape: Sequence[int]):
        """The JAX-side array of shape ``jax_shape`` whose torch-side array is ``y``: the exact inverse."""
        shapes = self._shapes(jax_shape)
        if tuple(y.shape) != shapes[-1]:
            raise ValueError(f"expected a torch-side array of shape {shapes[-1]}, got {tuple(y.shape)}")
        for (kind, values), before in zip(reversed(self.steps), reversed(shapes[:-1])):
            if kind == "transpose":
                inverse = tuple(sorted(range(len(values)), key=values.__getitem__))
                y = _permute(y, inverse)
            else:
                y = y.reshape(before)
        return y

    def to_json(self) -> list:
        return [[kind, list(values)] for kind, values in self.steps]

    @classmethod
    def from_json(cls, steps: list) -> "Layout":
        return cls(tuple((kind, tuple(values)) for kind, values in steps))

    def __str__(self) -> str:
        return " then ".join(f"{kind}({', '.join(map(str, values))})" for kind, values in self.steps) or "as is"
