"""ZeRO-3 with the optimizer state in files, stepped one bucket at a time: :class:`OffloadedZero3`.

``zero(inner, axis, stage=3)`` keeps the inner transform's state (Adam's two moments: twice the
parameter slices) on the devices between steps. Here it lives in files under a directory the user
gives, memory-mapped and unlinked at once (a crashed run leaves nothing on disk), as
``hybrid.torch.ZeRO3Optimizer(offload_dir=)`` keeps it and DeepSpeed's ZeRO-Infinity keeps it on
NVMe. A step brings one bucket's state in, runs the inner update on that bucket's slices, writes
the new state back and lets the device arrays go, bucket after bucket: the devices hold the
parameter slices, the gradient slices and one bucket's state.

Stepping bucket by bucket gives every bucket a state of its own (the inner transform initialised
on that bucket's slice alone): for elementwise transforms, masks and partitions (rewritten per
bucket, as ``zero`` rewrites them per element) it is the same arithmetic as ``zero``'s one update
over all buckets. Transforms that decide over all buckets at once are split as DeepSpeed's offload
splits its global-norm clip: a step first runs each bucket's part of every such decision
(``hybrid.jax.clip_by_global_norm``'s sum of squares, ``hybrid.jax.apply_if_finite``'s count of
non-finite shards; ``optax.clip_by_global_norm`` in a chain becomes the former, as in ``zero``),
sums them over the buckets, and then steps each bucket with the totals (``hybrid.jax._decisions``).
That is exact where the decisions see the gradients (first in the chain). A probe runs the inner
transform on two buckets together and stepped apart so, and refuses one whose updates differ,
saying why.

On XLA:CPU a state array put on a device from its file is the file's memory (no copy), so only the
new state the update writes is extra; the kernel's page cache may keep the files' pages in RAM
while memory is free and writes them back and evicts them when it is not.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hybrid.core._state_dir import offload_directory
from hybrid.jax._decisions import applying, measuring
from hybrid.jax.sharded._axis_aware import axis_aware
from hybrid.jax.sharded._masks import Binder, bind, contains_masks
from hybrid.jax.sharded._on_shards import on_shards
from hybrid.jax.sharded._params import ParamShards
from hybrid.jax.sharded.offload._probe import check_per_bucket, count_decisions
from hybrid.jax.sharded.offload._state_files import BucketFile
from hybrid.jax.sharded._slices import ZeroState, check_inner, zero_state
from hybrid.jax.sharded._zero import zero

class _OneBucket:
    """A :class:`Binder`'s masks and labels for bucket ``b`` alone (a 1-tuple per call)."""

    def __init__(self, binder, b: int):
        self.binder, self.b = binder, b

    def masks(self, mask) -> tuple:
        return (self.binder.masks(mask)[self.b],)

    def labels(self, param_labels, keys: list) -> tuple:
        return (self.binder.labels(param_labels, keys)[self.b],)


class _BucketState(NamedTuple):
    """How one bucket's state looks as global arrays: its tree, each leaf's key path, spec,
    sharding and shape."""

    treedef: object
    paths: list
    specs: list
    shardings: list
    shapes: list


class OffloadedZero3:
    """ZeRO stage 3 whose optimizer state is kept in files under ``offload_dir`` between steps.

    The user computes gradient slices as for ``zero(inner, axis, stage=3)`` (``jax.grad`` of a loss
    through :func:`hybrid.jax.gathered`, in a jitted ``shard_map``) and hands them to :meth:`step`,
    which updates one bucket at a time: its state is brought in from the files, ``inner`` updates
    the bucket's slices (divided by the axis size for DDP's mean, as ``zero`` does), the
    parameters take the updates (``optax.apply_updates``) and the new state goes back to the files.
    The devices hold the parameter and gradient slices and one bucket's state, not the whole state.

    >>> import jax, jax.numpy as jnp, numpy as np, optax, tempfile
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> import hybrid.jax as hj
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    >>> shards = jax.shard_map(lambda p: hj.shard_params(p, "dp"), mesh=mesh, in_specs=P(),
    ...                        out_specs=P("dp"))({"w": jnp.ones(3)})
    >>> opt = hj.OffloadedZero3(optax.adam(0.1), mesh, "dp", tempfile.mkdtemp())
    >>> opt.init(shards)
    >>> grad = jax.jit(jax.shard_map(jax.grad(hj.gathered(lambda p: jnp.sum(p["w"] ** 2))), mesh=mesh,
    ...                              in_specs=P("dp"), out_specs=P("dp")))
    >>> shards = opt.step(shards, grad(shards))
    >>> [round(float(w), 3) for w in hj.unshard_params(shards)["w"]], opt.offloaded_bytes() > 0
    ([0.9, 0.9, 0.9], True)

    Args:
      inner: an optax transform that is exact per bucket (elementwise, masks and partitions
        allowed; see :func:`check_per_bucket`).
      mesh: the mesh the shards live on.
      axis_name: its data-parallel axis, the one the shards were cut over.
      offload_dir: an existing writable directory, on a disk (tmpfs is warned about: its files
        live in memory).
      mean: divide the summed gradient slices by the axis size, as ``zero`` and DDP do.
      check_elementwise: refuse transforms that are not exact on slices or per bucket.
    """

    def __init__(self, inner: optax.GradientTransformation, mesh, axis_name: str, offload_dir, *,
                 mean: bool = True, check_elementwise: bool = True):
        if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
            raise ValueError(f"OffloadedZero3: axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        self.directory = offload_directory(offload_dir)
        inner = axis_aware(inner, axis_name)  # as zero: then refused below by the per-bucket probe
        check_inner(inner, axis_name, check_elementwise)
        if check_elementwise:
            check_per_bucket(inner, axis_name)
        self.inner, self.mesh, self.axis_name, self.mean = inner, mesh, axis_name, mean
        self._decisions = count_decisions(inner, axis_name)  # global clips and skips: measured before each step
        self._layout = None
        self._buckets: list[_BucketState] = []
        self._files: list[BucketFile] = []
        self._programs: dict = {}
        self._whole = None  # zero(stage=3)'s state tree and where each bucket's leaves sit in it

    # -- per-bucket programs -------------------------------------------------------------------
    def _bucket_tx(self, b: int):
        if not contains_masks(self.inner):
            return self.inner
        lay = self._layout
        binder = Binder(lay.layout.abstract(), lay.layout, lay.shards, jax.lax.axis_index(self.axis_name))
        return bind(self.inner, _OneBucket(binder, b))

    def _init_local(self, b: int, p):
        with on_shards(self.axis_name):
            return self._bucket_tx(b).init((p,))

    def _describe(self, b: int, dtype) -> _BucketState:
        n, size = self._layout.shards.world_size, self._layout.shards.shard_sizes[b]
        # vmap binds the axis and adds a leading axis of n: ndim beyond it tells a leaf with a
        # dimension (this device's, P(axis)) from a scalar (a step count, the same on every device).
        shapes = jax.eval_shape(jax.vmap(lambda p: self._init_local(b, p), in_axes=None, axis_size=n,
                                         axis_name=self.axis_name), jax.ShapeDtypeStruct((size,), dtype))
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
        leaves = [s for _, s in with_paths]
        specs = [PartitionSpec(self.axis_name) if s.ndim > 1 else PartitionSpec() for s in leaves]
        shapes = [(n * s.shape[1], *s.shape[2:]) if s.ndim > 1 else tuple(s.shape[1:]) for s in leaves]
        return _BucketState(treedef, [p for p, _ in with_paths], specs,
                            [NamedSharding(self.mesh, s) for s in specs], shapes)

    def _program(self, b: int, kind: str):
        key = (kind, b)
        if key not in self._programs:
            axis, meta, n = self.axis_name, self._buckets[b], self._layout.shards.world_size

            def init(p):
                return jax.tree.leaves(self._init_local(b, p))

            def measure(p, g):  # this bucket's part of every global decision, from the gradients alone
                g = g / n if self.mean else g
                tx = self._bucket_tx(b)
                with on_shards(axis), measuring() as recorded:
                    tx.update((g,), tx.init((p,)), (p,))
                return [v for _, v in recorded]

            def update(p, g, leaves, totals):
                state = jax.tree.unflatten(meta.treedef, leaves)
                g = g / n if self.mean else g  # as zero(..., stage=3): the backward summed over the axis
                with on_shards(axis), applying(totals):
                    u, state = self._bucket_tx(b).update((g,), state, (p,))
                (p,) = optax.apply_updates((p,), u)
                return p, jax.tree.leaves(state)

            shard, totals = PartitionSpec(axis), [PartitionSpec()] * self._decisions
            if kind == "init":
                program = jax.jit(jax.shard_map(init, mesh=self.mesh, in_specs=shard, out_specs=meta.specs))
            elif kind == "measure":
                program = jax.jit(jax.shard_map(measure, mesh=self.mesh, in_specs=(shard, shard), out_specs=totals))
            else:
                program = jax.jit(jax.shard_map(update, mesh=self.mesh, in_specs=(shard, shard, meta.specs, totals),
                                                out_specs=(shard, meta.specs)), donate_argnums=(0, 1, 2))
            self._programs[key] = program
        return self._programs[key]

    # -- the public steps -----------------------------------------------------------------------
    def _check(self, shards, what: str) -> None:
        if not isinstance(shards, ParamShards):
            raise TypeError(f"OffloadedZero3.{what}: expected the global ParamShards of hybrid.jax.shard_params "
                            f"(as a jitted shard_map returns them), got {type(shards).__name__}")
        n = self.mesh.shape[self.axis_name]
        if shards.layout.axis_name != self.axis_name or shards.layout.shards.world_size != n:
            raise ValueError(f"OffloadedZero3.{what}: the shards were cut for axis {shards.layout.axis_name!r} of "
                             f"size {shards.layout.shards.world_size}; this optimizer steps axis "
                             f"{self.axis_name!r} of size {n}")
        if self._layout is not None and shards.layout != self._layout:
            raise ValueError(f"OffloadedZero3.{what}: the shards' plan {shards.layout!r} differs from the one init "
                             f"saw ({self._layout!r}): re-run init after changing the model, caps, order or mesh")

    def init(self, shards: ParamShards) -> None:
        """Initialise the state for ``shards`` (global :class:`hybrid.jax.ParamShards`, or their
        shapes from :func:`hybrid.jax.abstract_shards` before a checkpoint load) into files, one
        bucket at a time; any state from an earlier ``init`` is dropped."""
        self._layout = None
        self._check(shards, "init")
        self._layout, self._programs, self._files, self._whole = shards.layout, {}, [], None
        self._dtypes = [x.dtype for x in shards.buckets]
        self._buckets = [self._describe(b, p.dtype) for b, p in enumerate(shards.buckets)]
        for b, p in enumerate(shards.buckets):
            if not isinstance(p, jax.Array):  # a shape: the init reads none of its values
                p = jax.make_array_from_callback(p.shape, p.sharding, lambda index, p=p: np.zeros(
                    len(range(*index[0].indices(p.shape[0]))), p.dtype))  # each device its slice alone
            leaves = self._program(b, "init")(p)
            self._files.append(BucketFile(self.directory, leaves, b))
            self._files[b].write(leaves)
            del leaves

    def step(self, shards: ParamShards, grads: ParamShards) -> ParamShards:
        """The updated parameter slices. ``shards`` and ``grads`` are consumed bucket by bucket
        (donated, as a jitted step with ``donate_argnums`` would take them): use the result."""
        if self._layout is None:
            raise ValueError("OffloadedZero3.step: call init(shards) first")
        self._check(shards, "step")
        if not isinstance(grads, ParamShards) or grads.layout != shards.layout:
            raise ValueError(f"OffloadedZero3.step: the gradients must be ParamShards of the shards' plan "
                             f"{shards.layout!r} (jax.grad through hybrid.jax.gathered), got "
                             f"{getattr(grads, 'layout', type(grads).__name__)!r}")
        totals = []
        if self._decisions:  # every bucket's part of the global clip / skip first, as DeepSpeed's offload
            parts = [self._program(b, "measure")(shards.buckets[b], grads.buckets[b]) for b in range(len(self._buckets))]
            totals = [sum(column) for column in zip(*parts)]
        new = []
        for b, meta in enumerate(self._buckets):
            state = self._files[b].read(meta.shardings, meta.shapes)
            p, state = self._program(b, "update")(shards.buckets[b], grads.buckets[b], state, totals)
            self._files[b].write(state)  # waits for the update; its device arrays go with `state`
            new.append(p)
            del state
        return ParamShards(tuple(new), shards.layout)

    # -- as zero(inner, axis, stage=3) keeps it: for checkpoints ------------------------------------
    def _as_whole(self):
        """The tree of ``zero(inner, axis, stage=3)``'s ZeroState for these shards, and where each
        bucket's state leaf sits among its leaves (``sources[b][i]``: an index into them).

        The whole state is the inner state over the tuple of all bucket slices, a bucket's over the
        1-tuple of its slice: a leaf with a dimension ends in the bucket's index there and in 0
        here; a scalar (a step count, the same in every bucket) has the same path in both."""
        if self._whole is not None:
            return self._whole
        lay, n = self._layout, self._layout.shards.world_size
        tx = zero(self.inner, self.axis_name, stage=3, mean=self.mean, check_elementwise=False)
        one_device = ParamShards(tuple(jax.ShapeDtypeStruct((size,), d)
                                       for size, d in zip(lay.shards.shard_sizes, self._dtypes)), lay)
        shapes = jax.eval_shape(jax.vmap(tx.init, in_axes=None, axis_size=n, axis_name=self.axis_name), one_device)
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(shapes.inner)
        index = {path: j for j, (path, _) in enumerate(with_paths)}
        sources = []
        for b, meta in enumerate(self._buckets):
            mine = []
            for path, spec in zip(meta.paths, meta.specs):
                whole = path[:-1] + (jax.tree_util.SequenceKey(b),) if spec != PartitionSpec() else path
                if whole not in index:
                    raise NotImplementedError(f"OffloadedZero3: bucket {b}'s state leaf {jax.tree_util.keystr(path)} "
                                              f"has no place in zero(inner, stage=3)'s state tree")
                mine.append(index[whole])
            sources.append(mine)
        self._whole = treedef, len(with_paths), sources  # fixed until the next init
        return self._whole

    def zero_state(self) -> ZeroState:
        """The state as ``zero(inner, axis, stage=3)`` keeps it: a :class:`hybrid.jax.ZeroState` of
        global arrays, what ``hybrid.checkpoint.jax.save`` saves. (To load, hand the optimizer
        itself to ``hybrid.checkpoint.jax.load(path, shards, opt)``: it fills the files a slot at a
        time; a resident state goes in through :meth:`load_zero_state`.)

        On XLA:CPU its arrays are the files' memory, nothing copied: the next :meth:`step`
        changes them, so save them before it. On an accelerator they are copies on the devices
        (the whole state at once)."""
        if self._layout is None:
            raise ValueError("OffloadedZero3.zero_state: call init(shards) first")
        treedef, count, sources = self._as_whole()
        leaves = [None] * count
        for b, meta in enumerate(self._buckets):
            for j, x in zip(sources[b], self._files[b].read(meta.shardings, meta.shapes)):
                leaves[j] = x
        return zero_state(jax.tree.unflatten(treedef, leaves), self._layout.shards)

    def fill_leaf(self, j: int, part_of_device) -> None:
        """Write leaf ``j`` of :meth:`zero_state`'s tree (``jax.tree.leaves(state.inner)[j]``)
        straight into the files: ``part_of_device(device, index)`` gives the numpy part of it that
        ``device`` holds (``index``: its slices of the global array). How a checkpoint load fills
        the state one leaf at a time, without the whole state on the devices."""
        _, _, sources = self._as_whole()
        for b, mine in enumerate(sources):
            for i, whole in enumerate(mine):
                if whole != j:
                    continue
                meta, file = self._buckets[b], self._files[b]
                for device, index in meta.shardings[i].addressable_devices_indices_map(meta.shapes[i]).items():
                    view = file.view(i, device.id)
                    view[...] = np.asarray(part_of_device(device, index)).reshape(view.shape)

    def load_zero_state(self, state: ZeroState) -> None:
        """Put ``state`` (a :class:`hybrid.jax.ZeroState` of ``zero(inner, axis, stage=3)`` for
        the shards ``init`` saw, as ``hybrid.checkpoint.jax.load`` returns it) into the files."""
        if self._layout is None:
            raise ValueError("OffloadedZero3.load_zero_state: call init(shards) first")
        if not isinstance(state, ZeroState):
            raise TypeError(f"OffloadedZero3.load_zero_state: expected a ZeroState, got {type(state).__name__}")
        if state.plan_fingerprint != self._layout.shards.fingerprint():
            raise ValueError(f"OffloadedZero3.load_zero_state: the state's shard plan {state.plan_fingerprint!r} "
                             f"differs from the shards' ({self._layout.shards.fingerprint()!r})")
        treedef, count, sources = self._as_whole()
        leaves, got = jax.tree.flatten(state.inner)
        if got != treedef:
            raise ValueError(f"OffloadedZero3.load_zero_state: the state is not this inner transform's: its tree "
                             f"{got} differs from {treedef}")
        for b, meta in enumerate(self._buckets):
            bucket = [leaves[j] for j in sources[b]]
            for i, (x, shape) in enumerate(zip(bucket, meta.shapes)):
                if tuple(x.shape) != shape:
                    raise ValueError(f"OffloadedZero3.load_zero_state: bucket {b}'s leaf "
                                     f"{jax.tree_util.keystr(meta.paths[i])} has shape {tuple(x.shape)}, not {shape}")
            self._files[b].write([jax.device_put(x, sharding) for x, sharding in zip(bucket, meta.shardings)])

    def offloaded_bytes(self) -> int:
        """Bytes of optimizer state this process keeps in files."""
        return sum(f.nbytes for f in self._files)
