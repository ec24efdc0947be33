"""An orbax checkpoint (orbax-checkpoint's standard API: ``StandardCheckpointer``, a
``CheckpointManager``; a flax params tree with its optax state, arrays sharded over any devices)
read as hybrid reads its own.

orbax stores a pytree: NamedTuples as dicts of their fields, tuples as lists, empty states as
None, every leaf under its key path (``opt_state.0.mu.Dense_0.kernel``). The reader finds the
parameters under ``params`` (flax's ``TrainState`` and the usual ``{"params", "opt_state",
"step"}`` dict; a flax ``variables`` dict inside is looked through), the buffers under
``batch_stats``, the training step at ``step`` (or the CheckpointManager's step), and in the rest
the optax state it knows: one ``ScaleByAdamState`` (fields ``count``, ``mu``, ``nu`` laid out
like the params: adam, adamw, ...) or ``TraceState`` (``trace``: sgd with momentum). Any other
array of the state (adagrad's ``sum_of_squares``, lion's lone ``mu``, adafactor's factored
moments) is refused, naming it. ``hybrid.jax.zero``'s own state (its moments as flat buckets) is
recognised by its bucket layout (``_zero_layout.py``). The state's other scalars (schedule counts,
``MultiSteps``' and ``apply_if_finite``'s counters) are carried (``run_state["carried"]``) and
params-shaped trees beside the moments (``MultiSteps``' ``acc_grads``) listed: the JAX loader puts
both back as saved, by key path. Arrays are read with orbax's own restore, whole, to the host,
only the leaves a load asks for. Every file is checked first (``_safety.py``).
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from hybrid.core import TensorSpec, canonical_dtype
from hybrid.checkpoint._foreign import ForeignCheckpoint, check_step, copy_ranges, foreign_manifest
from hybrid.checkpoint._manifest import CheckpointError, OptimizerInfo
from hybrid.checkpoint._other_state import CARRIED, carried
from hybrid.checkpoint._write import to_storage
from hybrid.checkpoint.orbax._safety import check_key, check_ocdbt, check_tree
from hybrid.checkpoint.orbax._zero_layout import bucket_runs, find_zero_node, zero3_params

_SLOTS = {"adam": ("mu", "nu"), "sgd": ("trace",)}
_KNOWN = ("optax's adam / adamw (ScaleByAdamState: count, mu, nu) and sgd with momentum (TraceState: trace), "
          "laid out like the params or as hybrid.jax.zero's flat buckets (its default bucket caps)")
_BESIDE = ("acc_grads",)  # params-shaped state beside the moments that load puts back (optax.MultiSteps)
_WHERE_TO_POINT = ("point at a CheckpointManager's directory, one of its step directories (root/3) or the "
                   "item directory inside it (root/3/default), or a StandardCheckpointer's directory")


def _item_dir(root: pathlib.Path, step: int | None, item: str | None) -> tuple[pathlib.Path, pathlib.Path, int | None]:
    """``(the directory orbax's handler reads, the checkpoint's directory, the manager's step)``
    for a checkpointer's directory, a CheckpointManager's step directory or its root."""
    steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())
    manager_step = None
    if steps and not (root / "_METADATA").exists():  # a CheckpointManager's root: pick the step
        if step is not None and step not in steps:
            raise CheckpointError(f"{root}: holds steps {steps}, not step {step}")
        manager_step = step if step is not None else steps[-1]
        root = root / str(manager_step)
    if (root / "_METADATA").exists():
        if manager_step is None and root.parent.name.isdigit():  # a manager's item directory: root/3/default
            manager_step = int(root.parent.name)
        return root, root, manager_step
    items = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "_METADATA").exists())
    if item is None:
        item = "default" if "default" in items else items[0] if len(items) == 1 else None
    if item is None or item not in items:
        raise CheckpointError(f"{root}: holds the items {items}: pass item= (one of them)" if items else
                              f"{root}: holds no orbax pytree (no _METADATA here nor in an item directory "
                              f"below it): {_WHERE_TO_POINT}")
    if manager_step is None and root.name.isdigit():
        manager_step = int(root.name)
    return root / item, root, manager_step


def _leaves(tree, parts=()):
    """``[(key path, leaf metadata)]`` of orbax's metadata tree (dicts, lists; None: an empty node)."""
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _leaves(v, (*parts, k))]
    if isinstance(tree, (list, tuple)):
        return [x for i, v in enumerate(tree) for x in _leaves(v, (*parts, i))]
    return [] if tree is None else [(parts, tree)]


def _shape(meta) -> tuple[int, ...]:
    return tuple(int(d) for d in (getattr(meta, "shape", None) or ()))


def _name(parts) -> str:
    return ".".join(map(str, parts))


def _skeleton(tree):
    """What orbax's partial restore takes for a subtree it is not to read: None, but inside a
    list a list of the same length (it matches lists element by element)."""
    return [_skeleton(v) for v in tree] if isinstance(tree, (list, tuple)) else None


def _prune(tree, wanted: set, parts=()):
    """orbax's partial-restore template: only the ``wanted`` leaves (lists keep their shape)."""
    if isinstance(tree, dict):
        kept = {k: _prune(v, wanted, (*parts, k)) for k, v in tree.items()}
        return {k: v for k, v in kept.items() if v is not None} or None
    if isinstance(tree, (list, tuple)):
        kept = [_prune(v, wanted, (*parts, i)) for i, v in enumerate(tree)]
        return [k if k is not None else _skeleton(v) for k, v in zip(kept, tree)] if any(
            k is not None for k in kept) else None
    return 0 if parts in wanted else None


def _at(tree, parts):
    for p in parts:
        tree = tree[p]
    return tree


class OrbaxCheckpoint(ForeignCheckpoint):
    """An orbax checkpoint directory, opened for reading (see the module docstring).

    Args:
      path: a ``StandardCheckpointer``'s directory, a ``CheckpointManager``'s (its latest step,
        or ``step``) or one of its step directories.
      step: the step directory of a CheckpointManager to open; for a checkpoint that records no
        step (no ``step`` leaf, no manager step, no Adam count), the training step.
      params_key: where the parameters lie in the tree (default ``"params"``; dotted for deeper).
      item: a CheckpointManager item's name, where a step holds several.
      params_like: the params tree a load reads into (``hybrid.checkpoint.jax.load`` passes it):
        names the buckets of ZeRO-3 ``ParamShards`` saved as they are (``params.buckets.<b>``),
        which hold no names.
      zero_stage: for ``hybrid.jax.zero``'s state saved without its ``plan_tag``, the stage that
        saved it (1 or 2: ``plan_buckets``' plan; 3: ``zero3_plan``'s). Where the tag is saved it
        decides; without either, a state that plans of different layouts fit alike is refused.

    >>> import os, tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp
    >>> params = {"Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
    >>> d = os.path.join(tempfile.mkdtemp(), "orbax")
    >>> with ocp.StandardCheckpointer() as checkpointer:
    ...     checkpointer.save(d, {"params": params, "opt_state": optax.adam(0.1).init(params), "step": 7})
    >>> ckpt = OrbaxCheckpoint(d)
    >>> ckpt.manifest.step, ckpt.manifest.optimizer.slots, [s.name for s in ckpt.manifest.plan.specs]
    (7, ('mu', 'nu'), ['Dense_0.bias', 'Dense_0.kernel'])
    """

    def __init__(self, path: str | os.PathLike, *, step: int | None = None, params_key: str = "params",
                 item: str | None = None, params_like=None, zero_stage: int | None = None):
        if zero_stage not in (None, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage!r}: the ZeRO stage that saved the state is 1, 2 or 3")
        root = pathlib.Path(os.path.realpath(path))
        if not root.is_dir():
            raise CheckpointError(f"{path}: no checkpoint directory there")
        self._dir, checkpoint_dir, manager_step = _item_dir(root, step, item)
        check_tree(checkpoint_dir)
        check_ocdbt(checkpoint_dir)
        self._tree = self._metadata_tree()
        leaves = _leaves(self._tree)
        for parts, _ in leaves:
            check_key(tuple(map(str, parts)), where=self._dir)
        where = str(self._dir)
        params_at = self._params_at(tuple(params_key.split(".")), where)
        n = len(params_at)
        params = {parts[n:]: meta for parts, meta in leaves if parts[:n] == params_at}
        self._parts = {("params", _name(p)): params_at + p for p in params}
        self._runs: dict[tuple[str, str], tuple[int, int]] = {}  # in zero's flat buckets: (offset, numel)
        self._params_plan = None
        shards = zero3_params(params, params_like, _shape)
        self._unnamed = shards is not None and shards[1] is None  # ParamShards, no params_like: buckets.<b>
        if shards is not None and not self._unnamed:  # ZeRO-3 ParamShards saved as they are: named by params_like
            named, self._params_plan, _ = shards
            params = named
            self._parts = {}
            for name, (b, offset, numel) in bucket_runs(self._params_plan).items():
                self._parts["params", name] = (*params_at, "buckets", b)
                self._runs["params", name] = (offset, numel)
        stats = {parts[1:]: meta for parts, meta in leaves if parts[:1] == ("batch_stats",)}
        self._parts.update({("buffers", _name(p)): ("batch_stats", *p) for p in stats})
        rest = [(parts, meta) for parts, meta in leaves
                if parts[:n] != params_at and parts[:1] != ("batch_stats",) and parts != ("step",)]
        # zero's ZeroState.plan_tag: which plan its flat buckets are laid out by. Read here, never
        # carried into the state a load fills (that state's own tag is its own plan's).
        tag_paths = [p for p, m in rest if p[-1:] == ("plan_tag",) and _shape(m) == ()]
        rest = [(p, m) for p, m in rest if p not in tag_paths]
        self._tags = self._restore_scalars(tag_paths)
        self._zero_stage = zero_stage
        optimizer = self._optimizer(params, rest, where)
        own_count = optimizer[1] + ("count",) if optimizer and optimizer[0] == "adam" else None
        others = [p for p, m in rest if _shape(m) == () and p != own_count]  # schedule counts, MultiSteps', ...
        scalars = self._restore_scalars([("step",)] * any(p == ("step",) for p, _ in leaves)
                                        + [own_count] * (own_count is not None))
        kept = self._restore(others)
        recorded = scalars.get(("step",), manager_step)
        count = scalars.get(optimizer[1] + ("count",)) if optimizer and optimizer[0] == "adam" else None
        if recorded is None and step is None:
            recorded = count
        run_step = check_step(recorded, step if manager_step is None else None, where=where,
                              what="no 'step' leaf, no CheckpointManager step, no Adam count")
        specs = [TensorSpec(_name(p), _shape(m), canonical_dtype(str(m.dtype))) for p, m in params.items()]
        info = None
        if optimizer is not None:
            kind, node = optimizer
            info = OptimizerInfo(kind, _SLOTS[kind], int(count) if count is not None else run_step, {})
            for slot in info.slots:
                if self._zero is not None:
                    for name, (b, offset, numel) in bucket_runs(self._zero[0]).items():
                        self._parts[slot, name] = (*node, slot, b)
                        self._runs[slot, name] = (offset, numel)
                else:  # unnamed ParamShards: the moments are the same buckets, slot.<b>
                    self._parts.update({(slot, _name(p)): (*node, slot, *p[self._unnamed:]) for p in params})
        buffers = {_name(p): (_shape(m), canonical_dtype(str(m.dtype))) for p, m in stats.items()}
        metadata = {"format": "orbax", "left_out": [_name(p) for p, _ in rest if not self._placed(p, optimizer)
                                                    and p not in kept and p not in self._state_arrays],
                    "state_arrays": [_name(p) for p in self._state_arrays]}
        if self._unnamed:
            metadata["unnamed_param_shards"] = (f"the params are ZeRO-3 ParamShards' flat buckets, which hold no names: "
                                                f"hybrid.checkpoint.jax.load names them from the params it is given")
        if self._zero is not None:
            metadata["zero_layout"] = {"buckets": self._zero[0].num_buckets, "plan": self._zero[0].fingerprint(),
                                       "lengths": [b.length for b in self._zero[0].buckets],
                                       "recognised_by": self._zero[2]}
        run_state = {CARRIED: carried([(p, v.item()) for p, v in kept.items()], source="orbax", where=where)} if kept else {}
        manifest = foreign_manifest("jax", specs, step=run_step, optimizer=info, buffers=buffers,
                                    metadata=metadata, run_state=run_state)
        super().__init__(checkpoint_dir, manifest, "orbax")
        self._checked = True  # the checks above ran before orbax read anything but the metadata

    # -- what the tree holds ---------------------------------------------------------------------

    def _metadata_tree(self) -> dict:
        import orbax.checkpoint as ocp

        try:
            tree = ocp.PyTreeCheckpointHandler().metadata(self._dir).tree
        except Exception as e:  # noqa: BLE001 - named
            raise CheckpointError(f"{self._dir}: orbax cannot read its tree metadata ({type(e).__name__}: {e})") from None
        if not isinstance(tree, dict):
            raise CheckpointError(f"{self._dir}: holds a {type(tree).__name__} at the top, not a dict of params and state")
        return tree

    def _params_at(self, key: tuple[str, ...], where: str) -> tuple:
        try:
            node = _at(self._tree, key)
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(f"{where}: holds no {'.'.join(key)!r} subtree (its top level: {sorted(self._tree)}): "
                                  f"pass params_key=") from None
        if isinstance(node, dict) and set(node) == {"params"}:  # a flax variables dict saved as "params"
            key = (*key, "params")
        return key

    def _optimizer(self, params: dict, rest: list, where: str):
        """``(kind, key path of its node)`` of the one optax state node hybrid knows, or None;
        any other array of the state is refused, naming it."""
        shapes = {p[self._unnamed:]: _shape(m) for p, m in params.items()}  # ParamShards' moments: slot.<b>
        found = []
        nodes = {parts[:i] for parts, _ in rest for i in range(len(parts))}
        for node in sorted(nodes, key=lambda p: tuple(map(str, p))):
            for kind, slots in _SLOTS.items():
                if all(self._like_params(rest, (*node, s), shapes) for s in slots):
                    found.append((kind, node))
        if len(found) > 1:
            raise CheckpointError(f"{where}: holds several optimizer states at {[_name(n) for _, n in found]}; "
                                  f"hybrid reads one")
        self._zero = None
        if not found and rest:  # hybrid.jax.zero's own state: flat buckets of the params' plan
            try:
                zero = find_zero_node({p: (_shape(m), str(m.dtype)) for p, m in params.items()}, rest, _SLOTS,
                                      _shape, self._params_plan, self._tags, self._zero_stage)
            except CheckpointError as e:
                raise CheckpointError(f"{where}: {e}") from None
            if zero is not None:
                kind, node, plan, n, how = zero
                found, self._zero = [(kind, node)], (plan, n, how)
        optimizer = found[0] if found else None
        # MultiSteps' acc_grads (params-shaped, beside a known optimizer): put back as saved by load.
        # Only those: any other array (adagrad's sum_of_squares) is a moment hybrid cannot carry.
        loose = [(p, m) for p, m in rest if not self._placed(p, optimizer) and _shape(m) != ()]
        like = sorted({p[:i] for p, _ in loose for i in range(1, len(p)) if optimizer is not None
                       and p[i - 1] in _BESIDE and self._like_params(loose, p[:i], shapes)}, key=len)
        self._state_arrays = [p for p, _ in loose if any(p[:len(n)] == n for n in like)]
        unknown = [(p, _shape(m)) for p, m in loose if p not in self._state_arrays]
        if unknown:
            parts, shape = unknown[0]
            raise CheckpointError(f"{where}: the optimizer state holds {_name(parts)!r} {list(shape)}"
                                  f"{f' and {len(unknown) - 1} more arrays' if len(unknown) > 1 else ''}, which no "
                                  f"optimizer hybrid reads keeps: it reads {_KNOWN}")
        return optimizer

    @staticmethod
    def _like_params(rest, prefix, shapes) -> bool:
        n = len(prefix)
        sub = {p[n:]: _shape(m) for p, m in rest if p[:n] == prefix}
        return bool(sub) and sub == shapes

    @staticmethod
    def _placed(parts, optimizer) -> bool:
        """Whether a leaf of the state is read: a slot or the count of the known node."""
        if optimizer is None:
            return False
        kind, node = optimizer
        n = len(node)
        return parts[:n] == node and len(parts) > n and parts[n] in (*_SLOTS[kind], "count")

    # -- reads -----------------------------------------------------------------------------------

    def _restore(self, wanted: list[tuple]) -> dict[tuple, np.ndarray]:
        """The ``wanted`` leaves (key paths) as host arrays, with orbax's own restore."""
        import jax
        import orbax.checkpoint as ocp

        wanted = sorted(set(wanted), key=lambda p: tuple(map(str, p)))
        if not wanted:
            return {}
        template = _prune(self._tree, set(wanted))
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), template)
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(
                self._dir, args=ocp.args.PyTreeRestore(item=template, restore_args=args, partial_restore=True))
        return {p: np.asarray(_at(restored, p)) for p in wanted}

    def state_arrays(self) -> dict[tuple, np.ndarray]:
        """``{key path: array}``: the params-shaped trees the optimizer state holds beside its
        moments (MultiSteps' ``acc_grads``), whole, which ``hybrid.checkpoint.jax.load`` puts back."""
        return self._restore(self._state_arrays)

    def _restore_scalars(self, wanted) -> dict[tuple, int]:
        return {p: int(v) for p, v in self._restore(wanted).items()}

    def _fill_many(self, wanted) -> None:
        arrays = self._restore([self._parts[k] for k in wanted])  # one restore for everything asked
        for (kind, name), ranges in wanted.items():
            flat = to_storage(arrays[self._parts[kind, name]]).reshape(-1)
            if (kind, name) in self._runs:  # a run of one of zero's flat buckets
                offset, numel = self._runs[kind, name]
                flat = flat[offset:offset + numel]
            copy_ranges(flat, ranges)
