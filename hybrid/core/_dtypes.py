"""Dtype names the planner understands, their sizes, and torch's enum codes.

dtypes are plain strings (``"float32"``, ``"bfloat16"``) so that plans are framework-neutral.
The torch codes (``c10::ScalarType``) and device-type codes (``c10::DeviceType``) are needed only
to reproduce the iteration order of torch's bucket assignment exactly (see ``_assign``).
"""

from __future__ import annotations

# name -> (itemsize in bytes, c10::ScalarType code)
_DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 0),
    "int8": (1, 1),
    "int16": (2, 2),
    "int32": (4, 3),
    "int64": (8, 4),
    "float16": (2, 5),
    "float32": (4, 6),
    "float64": (8, 7),
    "complex32": (4, 8),
    "complex64": (8, 9),
    "complex128": (16, 10),
    "bool": (1, 11),
    "bfloat16": (2, 15),
    "float8_e5m2": (1, 23),
    "float8_e4m3fn": (1, 24),
    "float8_e5m2fnuz": (1, 25),
    "float8_e4m3fnuz": (1, 26),
    "uint16": (2, 27),
    "uint32": (4, 28),
    "uint64": (8, 29),
    "float8_e8m0fnu": (1, 44),
}

_ALIASES = {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32",
}

# c10::DeviceType codes, by the type part of a device string ("cuda:1" -> "cuda").
_DEVICE_TYPES = {
    "cpu": 0, "cuda": 1, "mkldnn": 2, "opengl": 3, "opencl": 4, "ideep": 5, "hip": 6, "fpga": 7,
    "maia": 8, "xla": 9, "vulkan": 10, "metal": 11, "xpu": 12, "mps": 13, "meta": 14, "hpu": 15,
    "ve": 16, "lazy": 17, "ipu": 18, "mtia": 19, "privateuseone": 20,
}


def canonical_dtype(dtype: object) -> str:
    """The planner's name for a dtype given as a string, a numpy, torch or jax dtype.

    >>> canonical_dtype("torch.float32"), canonical_dtype("half")
    ('float32', 'float16')
    """
    if getattr(dtype, "itemsize", None) == 0:  # numpy "V0" and friends
        raise ValueError(f"dtype {dtype!r} has zero size")
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPES)}")
    return name


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name.

    >>> itemsize("bfloat16")
    2
    """
    return _DTYPES[canonical_dtype(dtype)][0]


def torch_scalar_type_code(dtype: str) -> int:
    return _DTYPES[canonical_dtype(dtype)][1]


def torch_device_code(device: str) -> tuple[int, int]:
    """``(c10::DeviceType, index)`` of a device string; index -1 when absent, as in torch."""
    kind, _, index = device.partition(":")
    if kind not in _DEVICE_TYPES:
        raise ValueError(f"unknown device type {device!r}; known: {sorted(_DEVICE_TYPES)}")
    return _DEVICE_TYPES[kind], int(index) if index else -1
