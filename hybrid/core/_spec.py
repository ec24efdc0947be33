"""TensorSpec: everything the planner sees of a tensor."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from hybrid.core._dtypes import canonical_dtype, itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, shape, dtype and device of one tensor; no data.

    Args:
      name: unique name, e.g. ``"layers.0.weight"`` (torch) or the JAX key-path name.
      shape: sizes of each dimension.
      dtype: dtype name (``"float32"``); torch/numpy dtype objects are accepted and canonicalised.
      device: an opaque device string (``"cpu"``, ``"cuda:0"``). Tensors on different devices
        never share a bucket.
      sparse: a tensor whose gradient is sparse gets a bucket of its own, as in torch's DDP.

    >>> TensorSpec("w", (3, 4), "float32").nbytes
    48
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"
    sparse: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec name must be a non-empty string, got {self.name!r}")
        shape = tuple(self.shape)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"tensor {self.name!r}: shape must be non-negative ints, got {self.shape!r}")
        try:
            dtype = canonical_dtype(self.dtype)
        except ValueError as e:
            raise ValueError(f"tensor {self.name!r}: {e}") from None
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"tensor {self.name!r}: device must be a non-empty string, got {self.device!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "sparse", bool(self.sparse))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "device": self.device, "sparse": self.sparse}

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        unknown = set(d) - {"name", "shape", "dtype", "device", "sparse"}
        if unknown:
            raise ValueError(f"TensorSpec JSON has unknown keys {sorted(unknown)}: {d!r}")
        return cls(d["name"], tuple(d["shape"]), d["dtype"], d.get("device", "cpu"), d.get("sparse", False))


def check_specs(specs: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    """Return specs as a tuple after checking types and that names are unique."""
    specs = tuple(specs)
    seen: set[str] = set()
    for i, s in enumerate(specs):
        if not isinstance(s, TensorSpec):
            raise TypeError(f"specs[{i}] is a {type(s).__name__}, expected TensorSpec")
        if s.name in seen:
            raise ValueError(f"duplicate tensor name {s.name!r} (specs[{i}])")
        seen.add(s.name)
    return specs


def specs_from_json(items: Sequence[dict]) -> tuple[TensorSpec, ...]:
    return check_specs(TensorSpec.from_json(d) for d in items)
