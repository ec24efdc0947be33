"""The run's other state: what another tool's checkpoint holds beside the model, the optimizer, the
step and the LR scheduler, which hybrid does not own but carries (a torchtitan run's ``dataloader``
and ``train_state``).

A reader lists each such entry as its path in the saved nested state dict and its value; the
manifest's ``run_state["carried"]`` keeps them as JSON, so a conversion to hybrid's format and back
gives them back as they were (bytes as bytes, a tensor with its dtype, shape and bits), and the
manifest body's digest, which every shard file records, covers them. Values are plain data:
numbers, strings, bytes, lists, tuples, dicts and tensors (``Tensor``: a dtype name and its stored
bits); a reader leaves out, by name, what is not.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np

from hybrid.checkpoint._dtypes import storage_dtype

CARRIED = "carried"


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A carried tensor: its dtype name (``"float32"``, ``"bfloat16"``) and its stored array
    (``_dtypes.storage_dtype``: bfloat16 as its uint16 bits), in its shape."""

    dtype: str
    array: np.ndarray


def encode(value: Any) -> dict:
    """``value`` as JSON (a dict naming its kind); TypeError for what is not plain data.

    >>> encode((1, b"ab", [2.5]))
    {'tuple': [{'value': 1}, {'bytes': 'YWI='}, {'list': [{'value': 2.5}]}]}
    """
    if isinstance(value, Tensor):
        a = np.ascontiguousarray(value.array)
        return {"tensor": {"dtype": value.dtype, "shape": list(a.shape),
                           "data": base64.b64encode(a.tobytes()).decode()}}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__ if type(value) in (list, tuple) else "list": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    raise TypeError(f"a {type(value).__module__}.{type(value).__name__}, which a checkpoint carries only as plain "
                    f"data (numbers, strings, bytes, lists, dicts, tensors)")


def decode(d: dict) -> Any:
    """The value :func:`encode` gave ``d`` for (tensors as :class:`Tensor`).

    >>> decode(encode({"pos": (1, b"ab")}))
    {'pos': (1, b'ab')}
    """
    (kind, v), = d.items()
    if kind == "tensor":
        raw = np.frombuffer(base64.b64decode(v["data"]), storage_dtype(v["dtype"]))
        return Tensor(v["dtype"], raw.reshape(v["shape"]).copy())
    if kind == "bytes":
        return base64.b64decode(v)
    if kind == "value":
        return v
    if kind in ("list", "tuple"):
        items = [decode(x) for x in v]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {decode(k): decode(x) for k, x in v}
    raise ValueError(f"unknown carried value kind {kind!r}")


def carried_entries(run_state: dict) -> list[tuple[tuple, Any]]:
    """``[(path, value)]``: the carried entries of a manifest's ``run_state``, decoded."""
    return [(tuple(e["path"]), decode(e["value"])) for e in run_state.get(CARRIED, {}).get("entries", [])]


def nest(entries, into: dict | None = None) -> dict:
    """The entries ``[(path, value)]`` as the nested dict they were saved from (``into``, updated).

    >>> nest([(("dataloader", "world_size"), 2), (("train_state", "step"), 7)])
    {'dataloader': {'world_size': 2}, 'train_state': {'step': 7}}
    """
    out = {} if into is None else into
    for path, value in entries:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def flatten(nested: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """``[(path, value)]`` of a nested dict, as DCP flattens a state dict (dicts are walked, the
    rest are values); :func:`nest`'s inverse.

    >>> flatten({"dataloader": {"world_size": 2}, "epoch": 3})
    [(('dataloader', 'world_size'), 2), (('epoch',), 3)]
    """
    out = []
    for key, value in nested.items():
        if isinstance(value, dict) and value:
            out += flatten(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def carried(entries, *, source: str, where: str) -> dict:
    """The manifest's ``run_state["carried"]`` for ``[(path, value)]``; a value that is not plain
    data is a ValueError naming its path."""
    encoded = []
    for path, value in entries:
        try:
            encoded.append({"path": list(path), "value": encode(value)})
        except TypeError as e:
            raise ValueError(f"{where}: {dotted(path)!r} is {e}") from None
    return {"from": source, "entries": encoded}


def dotted(path) -> str:
    return ".".join(map(str, path))
