"""What a ZeRO3 model's parameters are between uses: :class:`ParameterInShards` stand-ins.

As in torch's FSDP2, the module holds one parameter object per parameter while it is sharded (the
user's own ``nn.Parameter``: the names, ``model.parameters()`` and optimizer parameter groups see
it) and another, a view into the gathered bucket, while the module runs. The sharded one keeps
its shape, dtype, device and ``requires_grad`` and holds no memory of its own (a shared zero); anything that
would read its values raises a ``RuntimeError`` naming the parameter and what to do instead, so
no code reads stale or freed memory by mistake.

While a forward runs (or a ``gathered()`` block, or a backward that reads it) a stand-in stands in
for the working parameter instead: code that reads it outside its own module (a parent's
``x @ self.emb.weight.T``, a sibling, a functional op) computes with the gathered values, and
autograd sees the working parameter, the same leaf its module computes with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hybrid.torch.zero._zero2_grads import shared_zero

_ADVICE = ("it is sharded by hybrid.torch.ZeRO3: each rank holds a flat slice, and the whole parameter exists "
           "only while a forward (model(x) or model.module(x)) or its backward runs. Read it inside "
           "`with model.gathered():`, save it with model.state_dict(), step it with hybrid.torch.ZeRO3Optimizer.")

# Getters that would hand out the placeholder's values (a zero expanded to the parameter's shape).
_VALUE_GETTERS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# Methods that only read metadata, or set .grad (the ZeRO3 backward leaves a GradientInShards).
_METADATA = frozenset({"__set__", "__hash__", "size", "dim", "numel", "nelement", "element_size",
                       "is_floating_point", "is_complex", "is_contiguous", "stride"})


class ParameterInShards(torch.nn.Parameter):
    """A ZeRO3 model's parameter while it is sharded; see the module docstring.

    >>> p = torch.nn.Parameter(torch.ones(2, 3))
    >>> ParameterInShards.convert(p, "fc.weight")
    >>> p, p.shape, isinstance(p, torch.nn.Parameter)
    (ParameterInShards('fc.weight', shape=(2, 3)), torch.Size([2, 3]), True)
    >>> p.sum()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: parameter 'fc.weight': sum is not available: it is sharded by hybrid.torch.ZeRO3: ...
    """

    param_name: str
    _working: Callable[[], torch.Tensor | None] | None = None

    @staticmethod
    def convert(param: torch.nn.Parameter, name: str, working: Callable[[], torch.Tensor | None] | None = None,
                *, device: torch.device | None = None) -> None:
        """Turn ``param`` itself into a stand-in (its values must be kept elsewhere first).

        ``working``: returns the working parameter to compute with where a read is allowed now
        (a forward runs), None elsewhere; ``device``: where it lives (a meta parameter's new home).
        """
        with torch.no_grad():
            device = param.device if device is None else device
            value = shared_zero(param.dtype, device).expand(param.shape)
            if param.is_meta and value.device.type != "meta":  # .data cannot move a tensor off the meta device
                torch.utils.swap_tensors(param, torch.nn.Parameter(value, requires_grad=param.requires_grad))
            else:
                param.data = value
        param.__class__ = ParameterInShards
        param.param_name = name
        param._working = working

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
            allowed = name not in _VALUE_GETTERS
        else:
            allowed = name in _METADATA
        kwargs = kwargs or {}
        if allowed:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        working = {}
        for shard in tree_flatten((args, kwargs))[0]:
            if isinstance(shard, cls) and id(shard) not in working:
                found = shard._working() if shard._working is not None else None
                if found is None:
                    raise RuntimeError(f"parameter {shard.param_name!r}: {name} is not available: {_ADVICE}")
                working[id(shard)] = found
        args, kwargs = tree_map(lambda a: working.get(id(a), a) if isinstance(a, cls) else a, (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ParameterInShards({self.param_name!r}, shape={tuple(self.shape)})"

    def __deepcopy__(self, memo):
        raise RuntimeError(f"parameter {self.param_name!r}: deepcopy is not available: {_ADVICE}")
