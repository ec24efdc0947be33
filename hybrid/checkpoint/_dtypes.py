"""How a tensor of each dtype a model may hold is stored in a checkpoint, and read back bit for bit.

Every dtype the planner knows (``hybrid.core``: the float, complex, integer and bool types, bfloat16
and the float8 types) has a *storage* dtype, a numpy dtype of the same size that holds its bits:
itself where numpy has it, the unsigned integer of its size where numpy does not (bfloat16 as
``uint16``, the float8 types as ``uint8``, complex32 as ``uint32``). Loaders read into storage
dtypes and each frontend views the bits as its own dtype again, so nothing is ever converted.

A shard file's safetensors header names, for every tensor, a type numpy readers of safetensors
know (``safetensors.numpy.load_file`` opens every hybrid file). safetensors has no complex type
that every reader knows (``C64`` is recent, complex128 and complex32 have none), so a complex
tensor is written as its real view, ``torch.view_as_real``'s layout: its component type with a
trailing dimension of 2 (complex64 as ``F32[n, 2]``). The true dtype of every tensor whose header
type is not its own is recorded in the header's ``__metadata__`` under ``hybrid.dtypes`` (JSON,
key -> dtype), and in the manifest.
"""

from __future__ import annotations

import numpy as np

from hybrid.core import canonical_dtype

# logical dtype -> (storage numpy dtype, safetensors type of one component, components per element)
_LAYOUT: dict[str, tuple[str, str, int]] = {
    "float64": ("float64", "F64", 1), "float32": ("float32", "F32", 1), "float16": ("float16", "F16", 1),
    "bfloat16": ("uint16", "U16", 1),
    "float8_e4m3fn": ("uint8", "U8", 1), "float8_e5m2": ("uint8", "U8", 1), "float8_e4m3fnuz": ("uint8", "U8", 1),
    "float8_e5m2fnuz": ("uint8", "U8", 1), "float8_e8m0fnu": ("uint8", "U8", 1),
    "complex32": ("uint32", "F16", 2), "complex64": ("complex64", "F32", 2), "complex128": ("complex128", "F64", 2),
    "int64": ("int64", "I64", 1), "int32": ("int32", "I32", 1), "int16": ("int16", "I16", 1), "int8": ("int8", "I8", 1),
    "uint64": ("uint64", "U64", 1), "uint32": ("uint32", "U32", 1), "uint16": ("uint16", "U16", 1),
    "uint8": ("uint8", "U8", 1), "bool": ("bool", "BOOL", 1),
}
# The header's key for the true dtypes of tensors whose safetensors type is not their own.
DTYPES_KEY = "hybrid.dtypes"
SAFETENSORS_NUMPY = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
                     "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
                     "BOOL": "bool"}
SAFETENSORS_OF_NUMPY = {v: k for k, v in SAFETENSORS_NUMPY.items()}
STORABLE = tuple(_LAYOUT)


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a tensor of logical dtype ``dtype`` is stored (and read back) as.

    >>> storage_dtype("bfloat16"), storage_dtype("complex64"), storage_dtype("float8_e4m3fn")
    (dtype('uint16'), dtype('complex64'), dtype('uint8'))
    """
    return np.dtype(_LAYOUT[canonical_dtype(dtype)][0])


def is_stored_as_bits(dtype: str) -> bool:
    """Whether numpy lacks ``dtype``, so its tensors are stored as unsigned integers of its size."""
    dtype = canonical_dtype(dtype)
    return _LAYOUT[dtype][0] != dtype


def safetensors_entry(storage: np.dtype, numel: int, dtype: str | None = None) -> tuple[str, list[int], str | None]:
    """``(safetensors type, shape, true dtype or None)`` of a 1-D tensor of ``numel`` elements
    stored as ``storage``, of logical dtype ``dtype`` (default: the storage's own): complex as
    its real view ``[numel, 2]``; the true dtype where the safetensors type is not it.

    >>> safetensors_entry(np.dtype("complex64"), 3)
    ('F32', [3, 2], 'complex64')
    >>> safetensors_entry(np.dtype("uint16"), 3, "bfloat16")
    ('U16', [3], 'bfloat16')
    >>> safetensors_entry(np.dtype("float32"), 3)
    ('F32', [3], None)
    """
    dtype = canonical_dtype(storage if dtype is None else dtype)
    stored, component, parts = _LAYOUT[dtype]
    assert np.dtype(stored) == storage, f"a {dtype} tensor stored as {storage}"
    shape = [numel, 2] if parts == 2 else [numel]
    return component, shape, None if SAFETENSORS_NUMPY[component] == dtype else dtype


def entry_storage(safetensors_type: str, shape: tuple[int, ...], true_dtype: str | None) -> np.dtype:
    """The storage dtype of a header's tensor entry (its type, shape and recorded true dtype);
    ValueError where they disagree (a complex tensor's real view lacks its trailing 2)."""
    if true_dtype is None:
        return np.dtype(SAFETENSORS_NUMPY[safetensors_type])
    storage, component, parts = _LAYOUT[canonical_dtype(true_dtype)]
    if component != safetensors_type or (parts == 2 and (not shape or shape[-1] != 2)):
        raise ValueError(f"a {true_dtype} tensor written as {safetensors_type}{list(shape)}")
    return np.dtype(storage)


def check_storable(dtypes, *, where: str) -> None:
    """Raise CheckpointError naming the first tensor of ``dtypes`` (``{name: dtype}``, names
    as the user knows them) whose dtype no checkpoint holds. Called before anything is written.

    >>> try:
    ...     check_storable({"w": "float32", "q": "torch.qint8"}, where="save")
    ... except ValueError as e:
    ...     print(str(e)[:60])
    save: tensor 'q' is qint8, which hybrid checkpoints do not h
    """
    from hybrid.checkpoint._manifest import CheckpointError

    for name, dtype in dtypes.items():
        try:
            known = canonical_dtype(dtype) in _LAYOUT
        except ValueError:
            known = False
        if not known:
            shown = str(dtype).removeprefix("torch.")
            raise CheckpointError(f"{where}: tensor {name!r} is {shown}, which hybrid checkpoints do not hold (they "
                                  f"hold {', '.join(STORABLE)}); nothing was written")
