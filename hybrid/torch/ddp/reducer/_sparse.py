"""Sparse gradients in hybrid's DDP: ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``.

As torch's C++ ``Reducer``: a parameter whose module produces sparse gradients sits alone in its
bucket (``TensorSpec.sparse``, planned by ``hybrid.core``); that bucket has no flat buffer. Its
gradient itself is divided by the world size in place and all-reduced as a sparse COO tensor
(gloo sums the ranks' indices and values), and the reduced tensor is copied back into ``.grad``
in place. ``gradient_as_bucket_view`` does not apply to it; a comm hook sees the sparse tensor as
``bucket.buffer()`` and an empty ``bucket.gradients()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

_NOT_SPARSE_HINT = ("only the weights of nn.Embedding / nn.EmbeddingBag modules built with sparse=True "
                    "are reduced as sparse gradients")


def sparse_placeholder(param: torch.Tensor) -> torch.Tensor:
    """An empty sparse gradient shaped like ``param``, one sparse dimension as an embedding's: a
    sparse bucket's tensor before its first reduction (what a joined rank all-reduces zeros of).

    >>> sparse_placeholder(torch.zeros(5, 3)).sparse_dim(), sparse_placeholder(torch.zeros(5, 3)).dense_dim()
    (1, 1)
    """
    indices = torch.empty(1, 0, dtype=torch.long, device=param.device)
    values = torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=True)


def refuse_sparse_in_dense(params, names, members) -> None:
    """Raise torch's error, naming the parameter, when a member of a dense bucket got a sparse
    gradient (what a copy into the bucket failed on: a sparse tensor has no storage to read)."""
    for m in members:
        grad = params[m].grad
        if grad is not None and grad.layout != torch.strided:
            raise NotImplementedError(
                f"Cannot access storage of SparseTensorImpl (parameter {names[m]!r} received a "
                f"{grad.layout} gradient, but DistributedDataParallel expects a dense one: "
                f"{_NOT_SPARSE_HINT})")


class SparseBuckets:
    """The sparse gradients of one reducer, each a bucket of its own.

    Owns ``metadata`` (torch's ``_set_sparse_metadata``: per sparse parameter name, the sorted
    ids of the rows that exist globally; applied to one reduction only, and not pickled). The
    reducer calls :meth:`gradient` when a sparse bucket is ready (the tensor it reduces: the
    bucket's ``flat`` entry, torch's ``bucket.gradients``) and :meth:`finish` with the reduced
    value. Errors torch's reducer logs are raised through ``logged`` (the reducer's: it records
    them in the DDP's logging data).
    """

    def __init__(self, params: list[torch.Tensor], names: list[str]):
        self._params, self._names = params, names
        self.metadata: dict[str, torch.Tensor] | None = None

    def set_metadata(self, global_unique_ids: Mapping[str, torch.Tensor]) -> None:
        """torch's ``_set_sparse_metadata``: per sparse parameter name, the sorted ids of the rows
        that exist globally. A sparse gradient's row indices are then replaced by their positions
        in those ids before the comm hook; after it, the hook's result is taken as dense values,
        one row per id, and ``.grad`` becomes the sparse tensor of those rows (torch's reducer).

        On gloo this only works with a comm hook that returns the dense rows of all ids (and as
        many ids as the table has rows): the default all-reduce returns a sparse tensor, which
        torch's reducer, and this one, refuse there ("expected values to be a dense tensor").
        """
        if not isinstance(global_unique_ids, Mapping) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in global_unique_ids.items()):
            raise TypeError("_set_sparse_metadata(): incompatible function arguments. The following argument "
                            "types are supported:\n    1. (global_unique_ids: Mapping[str, torch.Tensor]) -> None"
                            f"\n\nInvoked with: {global_unique_ids!r:.200}")
        self.metadata = dict(global_unique_ids)

    def gradient(self, i: int, logged: Callable[[Exception], Exception]) -> torch.Tensor:
        """Parameter ``i``'s sparse gradient as it is reduced (torch's ``mark_variable_ready_sparse``):
        its ``.grad``, checked, with its rows renumbered by the metadata if any."""
        param = self._params[i]
        grad = param.grad
        if grad is None:
            raise logged(RuntimeError(
                f"Expected sparse gradient to be defined. (parameter {self._names[i]!r} got no gradient "
                "in this iteration: DistributedDataParallel cannot reduce an unused sparse parameter; "
                "use it on every rank in every iteration, or build its module with sparse=False)"))
        if grad.layout != torch.sparse_coo:
            raise logged(RuntimeError(
                f"Expected variable to have sparse gradient. (parameter {self._names[i]!r} belongs to a "
                f"module with sparse=True but received a {grad.layout} gradient: it is used outside its "
                "embedding lookup, e.g. shared with another layer; build that module with sparse=False)"))
        if self.metadata is not None:
            # Row ids become positions in the global ids; the gradient is replaced (torch's too).
            grad = grad.coalesce()
            positions = torch.searchsorted(self._metadata_ids(i, grad.device, logged), grad.indices(),
                                           out_int32=False, right=False)
            grad = param.grad = torch.sparse_coo_tensor(positions, grad.values(), grad.size())
        return grad

    def _metadata_ids(self, i: int, device, logged) -> torch.Tensor:
        """Parameter ``i``'s global ids as a ``(1, K)`` int64 tensor (torch's sparse_tensor_indices)."""
        ids = self.metadata.get(self._names[i])
        if ids is None:
            raise logged(RuntimeError(f"param: {self._names[i]} not found in sparse metadata"))
        return ids.to(torch.long).unsqueeze(0).to(device)

    def finish(self, i: int, grad: torch.Tensor, value: torch.Tensor,
               logged: Callable[[Exception], Exception]) -> None:
        """The reduced ``value`` of parameter ``i``'s sparse ``grad`` (the tensor :meth:`gradient`
        gave) into that ``.grad``, in place (torch's finalize_backward)."""
        if self.metadata is not None:
            ids = self._metadata_ids(i, grad.device, logged)
            if ids.numel() != grad.size(0):
                raise logged(RuntimeError("Sparse metadata and gradient size mismatch"))
            value = torch.sparse_coo_tensor(ids, value, grad.size())
        if value is not grad:
            grad.copy_(value)

    def end_reduction(self) -> None:
        """Every bucket is in: the metadata has served (torch's reducer applies it to one
        reduction only)."""
        self.metadata = None
