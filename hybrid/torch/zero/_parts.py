"""The small pieces of hybrid's ZeroRedundancyOptimizer: input checks, specs, copies, group sync."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hybrid.core import TensorSpec, canonical_dtype


def _spec(index: int, param: torch.Tensor, *, with_device: bool = True) -> TensorSpec:
    # Names only need to be unique; the global index keeps them stable across ranks.
    device = str(param.device) if with_device else "cpu"
    return TensorSpec(f"param{index}", tuple(param.shape), canonical_dtype(param.dtype), device)


def _copy_to_device(value: Any, device: torch.device) -> Any:
    """Copies of every tensor in nested lists, tuples and dicts, moved to ``device``."""
    if isinstance(value, torch.Tensor):
        # A copy, never an alias: a loaded state dict must not change when we step.
        return value.to(device, copy=True)
    if isinstance(value, (list, tuple)):
        values = [_copy_to_device(v, device) for v in value]
        return values if isinstance(value, list) else tuple(values)
    if isinstance(value, dict):
        return {k: _copy_to_device(v, device) for k, v in value.items()}
    return value


def _check_params(params: Any) -> tuple[list, list[torch.Tensor]]:
    """``(params as a list, every parameter)``; raises torch's errors for bad input."""
    if isinstance(params, torch.Tensor):
        raise TypeError("`params` argument should be an iterable of "
                        f"Tensors, but got {torch.typename(params)}")
    try:
        items = list(params)
    except TypeError as e:
        raise TypeError("`params` argument should be an iterable of Tensors"
                        f" or dicts, but got {torch.typename(params)}") from e
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, torch.Tensor) for p in items):
        return items, items
    if not all(isinstance(p, dict) for p in items):
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    all_params, groups = [], []
    for group in items:
        if "params" not in group:
            raise ValueError("Each parameter group passed-in via `params` must "
                             "have a 'params' key mapping to the parameters in the group")
        group_params = group["params"]
        if isinstance(group_params, torch.Tensor):
            group_params = [group_params]
        elif not isinstance(group_params, set):  # a set is left for torch's TypeError
            # Materialise generators (``model.parameters()``): read twice, they would be empty
            # the second time (torch's own ZeroRedundancyOptimizer drops such a group's params).
            group_params = list(group_params)
            group = {**group, "params": group_params}
        all_params.extend(group_params)
        groups.append(group)
    return groups, all_params


def _check_same_dense_type(params: list[torch.Tensor]) -> None:
    # torch.typename covers dtype and layout ("torch.FloatTensor", "torch.sparse.FloatTensor").
    typename = torch.typename(params[0])
    if params[0].is_sparse:
        raise ValueError("ZeroRedundancyOptimizer only supports using "
                         f"the same dense type for all parameters but got {typename}")
    for p in params[1:]:
        other = torch.typename(p)
        if other != typename:
            raise ValueError("ZeroRedundancyOptimizer only supports using the same dense type for "
                             f"all parameters but got both {typename} and {other}")


def _sync_param_groups(src: list[dict], dst: list[dict]) -> None:
    """Copy hyperparameters (everything but ``params``) group by group, as torch does."""
    assert len(src) == len(dst), "mismatch between number of source and destination parameter groups"
    for s, d in zip(src, dst):
        for key, value in s.items():
            if key != "params":
                d[key] = value


def _refuse_sparse(ddp, who: str) -> None:
    """ZeRO shards flat dense buckets: a DDP bucket holding a sparse gradient cannot be sharded."""
    for bucket in ddp.bucket_plan.buckets:
        if bucket.sparse:
            name = ddp._names[bucket.members[0]]
            raise NotImplementedError(
                f"{who} does not support sparse gradients: parameter {name!r} gets one (an nn.Embedding "
                "or nn.EmbeddingBag with sparse=True). Use sparse=False for it, or step a plain "
                "optimizer after DistributedDataParallel's backward (sparse gradients are all-reduced "
                "there), or hybrid.torch.ZeroRedundancyOptimizer without overlap_with_ddp.")


def resolve_groups(param_groups, names: list[str], index_of: dict[int, int], who: str, wrapper: str
                   ) -> tuple[list[int], list[int], list[dict[str, Any]]]:
    """torch-style parameter groups over a flat-sharded module's parameters, each exactly once:
    ``(group of each parameter, parameter indices in torch's state-dict numbering, each group's
    options)``. ``names[i]`` and ``index_of[id(p)] = i`` number the module's parameters; ``who``
    (the optimizer) and ``wrapper`` (the module's class) name them in errors.

    >>> ps = [torch.nn.Parameter(torch.ones(1)) for _ in range(3)]
    >>> resolve_groups([{"params": ps[2:]}, {"params": ps[:2], "lr": 0.1}], ["a", "b", "c"],
    ...                {id(p): i for i, p in enumerate(ps)}, "ZeRO2", "DDP")
    ([1, 1, 0], [2, 0, 1], [{}, {'lr': 0.1}])
    """
    if param_groups is None:
        return [0] * len(names), list(range(len(names))), [{}]
    group_of: list[int | None] = [None] * len(names)
    order, options = [], []
    for g, group in enumerate(list(param_groups)):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param_groups[{g}] must be a dict with a 'params' entry, got {type(group).__name__}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            i = index_of.get(id(p))
            if i is None:
                raise ValueError(f"param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is not a "
                                 f"parameter of the {wrapper} module")
            if group_of[i] is not None:
                raise ValueError(f"parameter {names[i]!r} appears in param_groups[{group_of[i]}] and "
                                 f"param_groups[{g}]")
            group_of[i] = g
            order.append(i)
        options.append({k: v for k, v in group.items() if k != "params"})
    missing = [names[i] for i, g in enumerate(group_of) if g is None]
    if missing:
        raise ValueError(f"parameters in no group: {missing} ({who} shards every parameter of the module)")
    return group_of, order, options


def run_closure(closure) -> Any:
    """``closure()`` with gradients enabled (an optimizer's ``step`` runs under ``no_grad``), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


@contextlib.contextmanager
def grads_on_masters(segments, masters: list[torch.Tensor], grads) -> Iterator[None]:
    """For one inner optimizer step: each master segment's ``.grad`` is its slice of its bucket's
    gradient (``grads[bucket]``; None where a bucket has none), and None again afterwards, also
    when the step raised, so no view into a gradient bucket outlives the step.

    >>> w = torch.zeros(2)  # the master of elements 1..2 of bucket 0
    >>> class Seg: bucket, lo, hi = 0, 1, 3
    >>> with grads_on_masters([Seg], [w], [torch.arange(4.0)]):
    ...     w.grad.tolist()
    [1.0, 2.0]
    >>> w.grad is None
    True
    """
    for seg, master in zip(segments, masters):
        g = grads[seg.bucket] if grads else None
        master.grad = None if g is None else g[seg.lo:seg.hi]
    try:
        yield
    finally:
        for master in masters:
            master.grad = None


def cleared_slices(slices: list, set_to_none: bool) -> list:
    """A sharded optimizer's ``zero_grad`` of its gradient slices: all ``None``, or each zeroed in
    place (``None`` stays ``None``), as ``torch.optim.Optimizer.zero_grad`` treats ``.grad``.

    >>> g = [torch.ones(2), None]
    >>> cleared_slices(g, set_to_none=False)[0].tolist(), cleared_slices(g, set_to_none=True)
    ([0.0, 0.0], [None, None])
    """
    if set_to_none:
        return [None] * len(slices)
    for g in slices:
        if g is not None:
            g.zero_()
    return slices
