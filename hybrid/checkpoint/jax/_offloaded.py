"""Loading a checkpoint's optimizer state into :class:`hybrid.jax.OffloadedZero3`'s files, one
slot at a time: what ``hybrid.checkpoint.jax.load(path, params, opt)`` does when ``opt`` is one.

The in-memory load builds the whole state on the devices (every slot at once, read into numpy
first). Here each slot (Adam's ``mu``, then ``nu``) is read alone, this process's ranks' slices,
and written into the files bucket by bucket; then the read buffers go. So a process holds one
slot's slices beside its parameters at most, as ``hybrid.checkpoint.torch.load`` does for
``ZeRO3Optimizer(offload_dir=)``.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from hybrid.core import shard_flat
from hybrid.jax import OffloadedZero3
from hybrid.jax._specs import _Layout
from hybrid.checkpoint._manifest import CheckpointError
from hybrid.checkpoint._reader import CheckpointReader
from hybrid.checkpoint.jax._tree import _SLOTS, _as_dtype, _check_zero, _nodes, _rank, _slot_node


def load_offloaded(ckpt: CheckpointReader, layout: _Layout, opt: OffloadedZero3, refuse_per_parameter) -> None:
    """Fill ``opt``'s files from ``ckpt``'s optimizer state (``layout``: the shards' bucket layout)."""
    info = ckpt.manifest.optimizer
    if info is None:
        raise CheckpointError(f"{ckpt.path}: holds no optimizer state (saved without an optimizer)")
    refuse_per_parameter(ckpt, info)
    whole = opt.zero_state()  # its structure (on XLA:CPU views of the files: nothing is copied)
    node, zero = _slot_node(whole)
    slots = _SLOTS[type(node)]
    if set(info.slots) != set(slots):
        raise CheckpointError(f"{ckpt.path}: holds {info.name} state {list(info.slots)}, but the optax state "
                              f"({type(node).__name__}) keeps {list(slots)}")
    n = opt.mesh.shape[opt.axis_name]
    _check_zero(zero, layout, n)
    plan = ckpt.reshard_to(shard_flat(layout.plan, n))
    leaves = jax.tree.leaves(whole.inner)
    index_of = {id(x): j for j, x in enumerate(leaves)}
    first = getattr(node, slots[0])[0]
    ranks = sorted({_rank(i, first, n) for i in first.sharding.addressable_devices_indices_map(first.shape).values()})
    for slot in slots:
        read = ckpt.slices_of([slot], plan, ranks)  # this slot's slices of this process's ranks
        for b, flat in enumerate(getattr(node, slot)):
            opt.fill_leaf(index_of[id(flat)], lambda device, index, flat=flat, b=b:
                          _as_dtype(read[slot, _rank(index, flat, n)][b], flat))
        del read
    counts = [node.count] if "count" in node._fields else []
    counts += [x.count for x in _nodes(whole.inner) if isinstance(x, optax.ScaleByScheduleState)]
    for count in counts:
        opt.fill_leaf(index_of[id(count)], lambda device, index, count=count: np.asarray(info.count, count.dtype))

