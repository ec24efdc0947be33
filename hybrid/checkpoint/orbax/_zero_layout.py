"""``hybrid.jax.zero``'s own state in an orbax checkpoint: its flat bucket layout recognised.

A user who saves ``{"params": p, "opt_state": zero_state, "step": s}`` with orbax's
``CheckpointManager`` or ``StandardCheckpointer`` stores zero's :class:`~hybrid.jax.ZeroState` as
orbax stores any pytree: ``opt_state.inner.<chain index>...mu.<bucket>``, one 1-D array per bucket
of the shard plan (the whole padded bucket, ``n * ceil(length / n)`` elements over ``n``
devices). The plan's fingerprint is static pytree metadata, so orbax does not write it: the plan is
rebuilt from the params' names, shapes and dtypes with zero's defaults (stages 1-2:
``hybrid.core.plan_buckets``; stage 3: ``hybrid.core.zero3_plan``, the plan of ``shard_params``)
and recognised by ``ZeroState.plan_tag``, an array leaf orbax does write (the plan fingerprint's
first 32 bits). A save without the tag is read by the plan of the ``zero_stage`` the reader is
given, else by the number and padded lengths of its buckets where they tell one layout; where
plans of different layouts fit alike it is refused, naming them. Each parameter's moment is then
the run ``[offset, offset + numel)`` of its bucket, whatever the device count it was saved at.
"""

from __future__ import annotations

from hybrid.core import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES, BucketPlan
from hybrid.checkpoint._manifest import CheckpointError


def _specs(params: dict) -> list:
    """TensorSpecs of the params ``{key path: (shape, dtype)}`` named and ordered as
    ``hybrid.jax.specs`` names a tree's leaves (key paths joined by ".", JAX's leaf order: dict keys
    sorted), without importing JAX's side (``info`` imports neither optax nor flax)."""
    from hybrid.core import TensorSpec, canonical_dtype

    def order(parts):
        return tuple((isinstance(p, str), p) for p in parts)  # list indices (ints) numerically

    return [TensorSpec(".".join(map(str, parts)), tuple(shape), canonical_dtype(dtype))
            for parts, (shape, dtype) in sorted(params.items(), key=lambda kv: order(kv[0]))]


STAGES_1_2 = "zero stages 1-2 (plan_buckets, default caps)"
STAGE_3 = "zero stage 3 (zero3_plan, default caps)"
SAVED_SHARDS = "the saved ParamShards' plan"  # stage 3's, its params saved as they are


def candidate_plans(params: dict) -> list[tuple[str, BucketPlan]]:
    """``[(what, plan)]``: the bucket plans ``zero`` makes of these params (``{key path: (shape,
    dtype)}``) with its defaults (stages 1-2, then stage 3); none where they cannot be planned."""
    from hybrid.core import plan_buckets, zero3_plan

    try:
        specs = _specs(params)
        if not specs or any(not s.dtype.startswith(("float", "bfloat")) for s in specs):
            return []
        return [(STAGES_1_2, plan_buckets(specs, bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES,
                                          first_bucket_cap_bytes=DEFAULT_FIRST_BUCKET_CAP_BYTES)),
                (STAGE_3, zero3_plan(specs, bucket_cap_bytes=None, first_bucket_cap_bytes=None))]
    except (TypeError, ValueError):
        return []


def _stage_fits(what: str, zero_stage: int | None) -> bool:
    """Whether the candidate plan ``what`` is the plan of ``zero_stage`` (any, where None)."""
    return zero_stage is None or (zero_stage == 3) == (what != STAGES_1_2)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes and nbytes % (1 << 20) == 0 else f"{nbytes:,} bytes"


def _described(what: str, plan: BucketPlan) -> str:
    """A candidate plan as an error names it: which stages, its caps, its tag."""
    limits = plan.size_limits
    caps = (f"first bucket {_size(limits[0])}, then {_size(limits[-1])}" if len(limits) > 1
            else f"{_size(limits[0])} a bucket")
    return f"{what.replace('default caps', caps)}, plan_tag {plan.tag():#010x}"


def _ambiguous(leaf: str, fits: list) -> CheckpointError:
    """The error of an untagged state that plans of other layouts fit alike: which, and how to say."""
    return CheckpointError(
        f"{leaf}: zero's flat buckets there carry no plan_tag (saved before ZeroState kept one), and "
        f"{len(fits)} bucket plans hybrid rebuilds from the params saved beside them fit their lengths but "
        f"put the parameters at other offsets: {'; '.join(_described(what, c) for what, c, _ in fits)}. "
        f"Reading it by either could put one parameter's moments on another, so say which stage saved it: "
        f"hybrid.checkpoint.jax.load(hybrid.checkpoint.open_checkpoint(path, zero_stage=3), params, opt_state) "
        f"(zero_stage=1 or 2: the stages 1-2 plan), or python -m hybrid checkpoint info|convert ... --zero-stage 3")


def padded_world(plan: BucketPlan, sizes: list[int]) -> int | None:
    """The smallest device count ``n`` whose padded buckets (``n * ceil(length / n)``) have
    ``sizes``, or None (any divisor of a count fits alike: the layout is the same up to padding).

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> plan = plan_buckets([TensorSpec("w", (10,), "float32")])
    >>> padded_world(plan, [12]), padded_world(plan, [10]), padded_world(plan, [9])
    (3, 1, None)
    """
    if len(sizes) != plan.num_buckets or any(s < b.length for s, b in zip(sizes, plan.buckets)):
        return None
    for n in range(1, max(sizes) + 1):
        if all(n * -(-b.length // n) == s for s, b in zip(sizes, plan.buckets)):
            return n
    return None


def bucket_runs(plan: BucketPlan) -> dict[str, tuple[int, int, int]]:
    """``{parameter name: (bucket, offset, numel)}``: where each parameter lies in the flat buckets.

    >>> from hybrid.core import TensorSpec, plan_buckets
    >>> bucket_runs(plan_buckets([TensorSpec("w", (2, 3), "float32"), TensorSpec("b", (3,), "float32")]))
    {'w': (0, 0, 6), 'b': (0, 6, 3)}
    """
    return {plan.specs[m].name: (b, o, k) for b, bucket in enumerate(plan.buckets)
            for m, o, k in zip(bucket.members, bucket.offsets, bucket.numels)}


def _tag_of(node: tuple, tags: dict) -> tuple[tuple, int] | None:
    """``(key path, value)`` of the ``plan_tag`` of the ZeroState whose ``inner`` holds ``node``."""
    for path, value in tags.items():
        if node[:len(path)] == (*path[:-1], "inner"):
            return path, value
    return None


def find_zero_node(params: dict, rest: list, slots_by_kind: dict, shape_of, plan: BucketPlan | None = None,
                   tags: dict | None = None, zero_stage: int | None = None) -> tuple | None:
    """``(kind, node, plan, n, how)`` for the one zero state node of ``rest`` (orbax's ``[(key path,
    metadata)]`` of the optimizer state) whose slots are flat buckets of a plan of ``params``
    (``{key path: (shape, dtype)}``), or None; ``how`` says what told the plan. ``plan``: the one
    plan it can be (the saved ParamShards': stage 3); else zero's plans with default caps (stages
    1-2, stage 3).

    ``tags``: ``{key path: value}`` of the saved ``ZeroState.plan_tag`` leaves. A tagged node is
    read by the plan of that tag alone (stages 1-2 and stage 3 cut small models into buckets of the
    same lengths in another order: the lengths cannot tell them apart), and refused, naming it,
    where no plan hybrid can rebuild has it. An untagged node (a save from before the tag) is read
    by the plan of ``zero_stage`` where it is given (1 or 2: stages 1-2's; 3: stage 3's), else by
    the one plan whose lengths fit it; where several fit and lay the parameters out differently it
    is refused, naming them and ``zero_stage``.
    """
    if plan is not None and zero_stage in (1, 2):
        raise CheckpointError(f"zero_stage={zero_stage}, but the params are saved as ZeRO-3 ParamShards: "
                              f"the state beside them is stage 3's (drop zero_stage, or pass 3)")
    plans = [(SAVED_SHARDS, plan)] if plan is not None else candidate_plans(params)
    if not plans:
        return None
    tags = tags or {}
    found = []
    nodes = {parts[:i] for parts, _ in rest for i in range(len(parts))}
    for node in sorted(nodes, key=lambda p: tuple(map(str, p))):
        k = len(node)
        for kind, slots in slots_by_kind.items():
            per_slot = []
            for s in slots:
                sub = {p[k + 1:]: shape_of(m) for p, m in rest if p[:k + 1] == (*node, s)}
                if not sub or sorted(sub) != [(b,) for b in range(len(sub))] or any(len(v) != 1 for v in sub.values()):
                    break
                per_slot.append([sub[(b,)][0] for b in range(len(sub))])
            if len(per_slot) != len(slots) or any(x != per_slot[0] for x in per_slot):
                continue
            leaf = ".".join(map(str, (*node, slots[0])))
            tagged = _tag_of(node, tags)
            fits = [(what, c, padded_world(c, per_slot[0])) for what, c in plans]
            fits = [(what, c, n) for what, c, n in fits if n is not None]
            if tagged is not None:
                tag_path = ".".join(map(str, tagged[0]))
                if not any(candidate.tag() == tagged[1] for _, candidate in plans):
                    raise CheckpointError(
                        f"{tag_path}: zero's state there is laid out by the bucket plan tagged {tagged[1]:#010x}, "
                        f"which is none of the plans hybrid rebuilds from the params saved beside it "
                        f"({', '.join(f'{what}: {c.tag():#010x}' for what, c in plans)}): it was planned with other "
                        f"bucket caps, another leaf order or other params. Save the params zero was initialised "
                        f"with (at stage 3 the ParamShards as they are), with zero's default caps")
                fits = [(what, c, n) for what, c, n in fits if c.tag() == tagged[1]]
                if fits and not _stage_fits(fits[0][0], zero_stage):
                    raise CheckpointError(f"{tag_path}: zero_stage={zero_stage}, but the state's plan_tag "
                                          f"{tagged[1]:#010x} names the plan of {fits[0][0]}: drop zero_stage")
                how = "its plan_tag"
            elif zero_stage is not None:
                other = [what for what, _, _ in fits if not _stage_fits(what, zero_stage)]
                fits = [(what, c, n) for what, c, n in fits if _stage_fits(what, zero_stage)]
                if not fits and other:
                    raise CheckpointError(f"{leaf}: zero_stage={zero_stage}, but zero's buckets there do not fit "
                                          f"that stage's plan's lengths; they fit {other[0]}'s")
                how = f"zero_stage={zero_stage} (no plan_tag saved)"
            else:
                if len(fits) > 1 and any(bucket_runs(c) != bucket_runs(fits[0][1]) for _, c, _ in fits[1:]):
                    raise _ambiguous(leaf, fits)
                how = ("the buckets' lengths (no plan_tag saved: " +
                       ("the one plan that fits)" if len(fits) == 1 else "the plans that fit lay the parameters out alike)"))
            if fits:
                _, candidate, n = fits[0]
                found.append((kind, node, candidate, n, how))
    return found[0] if len(found) == 1 else None


def _key_name(key):
    for field in ("name", "key", "idx"):
        if hasattr(key, field):
            return getattr(key, field)
    return str(key)


def leaves_of(tree) -> dict[tuple, object]:
    """``{key path: leaf}`` of a params tree (its leaves have ``shape`` and ``dtype``), keyed as
    orbax keys its metadata."""
    import jax

    return {tuple(_key_name(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def zero3_params(saved: dict, like, shape_of) -> tuple[dict, BucketPlan, int] | None:
    """``(params by key path, plan, n)`` where the saved params (``{key path: metadata}`` under the
    params key) are ZeRO-3 ``ParamShards``' buckets (``buckets.<b>``, no names) of ``like``'s
    zero3 plan (default caps, as ``shard_params``), or None."""
    if not saved or any(p[:1] != ("buckets",) or len(p) != 2 for p in saved):
        return None
    if like is None:
        return {}, None, 0
    named = leaves_of(like)
    sizes = {p[1]: shape_of(m) for p, m in saved.items()}
    if sorted(sizes) != list(range(len(sizes))) or any(len(s) != 1 for s in sizes.values()):
        return None
    plans = [plan for what, plan in candidate_plans({p: (tuple(x.shape), str(x.dtype)) for p, x in named.items()})
             if "stage 3" in what]
    for plan in plans:
        n = padded_world(plan, [sizes[b][0] for b in range(len(sizes))])
        if n is not None:
            return named, plan, n
    return None
