"""The declared mapping between a JAX (flax) parameter tree and a torch module's parameters.

Names on both sides are "."-joined paths: torch's ``named_parameters()`` (``h.0.attn.c_attn.weight``)
and the key path of a JAX pytree leaf (``h_0.attn.c_attn.kernel``, :func:`hybrid.jax.specs`).
A :class:`Rule` pairs a JAX name template with a torch one over the same fields and says how the
array is laid out on each side (:class:`~hybrid.core.Layout`). Fields (``{module}``) stand for one
or more whole path segments, and a module path crosses by two conventions: a segment renamed by
``renames``, and flax linen's ``name_3`` for the fourth module of a list attribute, which torch's
``ModuleList`` calls ``name.3``.

Everything here is over names and shapes: no arrays, no framework. :meth:`ParamMapping.pair`
resolves the rules against the tensors of both sides into a :class:`~hybrid.core.ParamPairing`,
which then converts whole parameter sets both ways. A tensor no rule places, a rule whose layout
does not fit, a name on one side with no counterpart on the other: each is a
:class:`~hybrid.core.MappingError` naming the tensor and the nearest names, never a silent skip.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Mapping, Sequence

from hybrid.core.mapping._layout import Layout
from hybrid.core.mapping._pairing import MappingError, Pair, ParamPairing, errors_message, nearest

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SEGMENTS = r"[^.]+(?:\.[^.]+)*"
_LIST_ITEM = re.compile(r"^(.+)_(\d+)$")


@functools.lru_cache(maxsize=None)
def _compile(template: str) -> tuple[re.Pattern, tuple[str, ...]]:
    fields, parts, at = [], [], 0
    for m in _FIELD.finditer(template):
        parts += [re.escape(template[at:m.start()]), f"(?P<{m.group(1)}>{_SEGMENTS})"]
        fields.append(m.group(1))
        at = m.end()
    parts.append(re.escape(template[at:]))
    if len(set(fields)) != len(fields):
        raise ValueError(f"template {template!r} names a field twice")
    return re.compile("".join(parts)), tuple(fields)


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """A JAX name template, the torch name template of the same tensor, and the layout between them.

    Args:
      jax: the JAX-side name, with fields: ``"{module}.kernel"``.
      torch: the torch-side name over the same fields: ``"{module}.weight"``.
      layout: the steps from the JAX array to the torch array (default: the same array).
      ndim: the rule applies only to tensors of this rank (``None``: any rank).
      name: what the rule is for, shown in messages and by the plan inspector.
      grads_together: torch computes the gradients of this tensor's module in one backward node and
        accumulates them in registration order (a convolution, a norm: weight before bias), where
        JAX's backward computes them apart (the bias's sum first). The gradient-ready order
        (:meth:`ParamPairing.torch_ready_order`) needs to know where no torch step was observed;
        a Linear's bias is ready before its weight in both frameworks. ``None`` (the default)
        says neither: a norm-like module (a 1-D weight and a bias of its shape) counts as
        together, anything else not. ``False`` overrides that.

    >>> rule = Rule("{module}.w", "{module}.weight", Layout.transpose(1, 0), name="my Dense")
    >>> rule.match("enc.proj.w", 2)
    {'module': 'enc.proj'}
    """

    jax: str
    torch: str
    layout: Layout = Layout()
    ndim: int | None = None
    name: str = ""
    grads_together: bool | None = None

    def __post_init__(self):
        if not isinstance(self.layout, Layout):
            raise TypeError(f"rule {self.jax!r} -> {self.torch!r}: layout must be a Layout, got {self.layout!r}")
        (_, jax_fields), (_, torch_fields) = _compile(self.jax), _compile(self.torch)
        if set(jax_fields) != set(torch_fields):
            raise ValueError(f"rule {self.jax!r} -> {self.torch!r}: both templates must use the same fields, "
                             f"got {list(jax_fields)} and {list(torch_fields)}")

    def match(self, jax_name: str, ndim: int) -> dict[str, str] | None:
        """The fields of ``jax_name`` if this rule applies to it (name and rank), else None."""
        if self.ndim is not None and ndim != self.ndim:
            return None
        m = _compile(self.jax)[0].fullmatch(jax_name)
        return m.groupdict() if m else None

    def label(self) -> str:
        return self.name or f"{self.jax} -> {self.torch}"

    def to_json(self) -> dict:
        return {"jax": self.jax, "torch": self.torch, "layout": self.layout.to_json(), "ndim": self.ndim,
                "name": self.name, "grads_together": self.grads_together}

    @classmethod
    def from_json(cls, d: dict) -> "Rule":
        return cls(d["jax"], d["torch"], Layout.from_json(d["layout"]), d.get("ndim"), d.get("name", ""),
                   d.get("grads_together"))


# flax's own modules against torch's. A Conv kernel is (*spatial, in / groups, out), torch's
# (out, in / groups, *spatial); both compute a cross-correlation, so no flip.
FLAX_RULES: tuple[Rule, ...] = (
    Rule("{module}.kernel", "{module}.weight", Layout.transpose(1, 0), ndim=2,
         name="flax Dense kernel (in, out) / torch Linear weight (out, in)"),
    Rule("{module}.kernel", "{module}.weight", Layout.transpose(2, 1, 0), ndim=3,
         name="flax Conv kernel (W, I, O) / torch Conv1d weight (O, I, W)", grads_together=True),
    Rule("{module}.kernel", "{module}.weight", Layout.transpose(3, 2, 0, 1), ndim=4,
         name="flax Conv kernel (H, W, I, O) / torch Conv2d weight (O, I, H, W)", grads_together=True),
    Rule("{module}.kernel", "{module}.weight", Layout.transpose(4, 3, 0, 1, 2), ndim=5,
         name="flax Conv kernel (D, H, W, I, O) / torch Conv3d weight (O, I, D, H, W)", grads_together=True),
    Rule("{module}.embedding", "{module}.weight", name="flax Embed embedding / torch Embedding weight"),
    Rule("{module}.scale", "{module}.weight", name="flax norm scale / torch norm weight (LayerNorm, GroupNorm, ...)",
         grads_together=True),
    Rule("{module}.bias", "{module}.bias", name="bias"),
)


def _torchish(name: str) -> str:
    """``name`` with linen's list names as torch's (``h_0.ln.scale`` -> ``h.0.ln.scale``): for messages."""
    return ".".join(_LIST_ITEM.sub(r"\1.\2", s) for s in name.split("."))


def _shapes(tensors) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a dict of shapes or arrays, or of a sequence of TensorSpecs."""
    if isinstance(tensors, Mapping):
        items = tensors.items()
    else:
        items = [(s.name, s.shape) for s in tensors]
    return {str(n): tuple(int(d) for d in (s.shape if hasattr(s, "shape") else s)) for n, s in items}


@dataclasses.dataclass(frozen=True, slots=True)
class ParamMapping:
    """Rules, module renames and tied tensors between a JAX tree and a torch module; see :meth:`flax`.

    Args:
      rules: tried in order for each JAX tensor; the first that matches its name and rank places it.
      renames: ``(jax segment, torch segment)`` pairs for module names that differ
        (``("attention", "attn")``), applied to every segment of a field.
      tied: ``(torch alias, torch source)``: ``alias`` is ``source`` itself (an LM head tied to the
        token embedding); the JAX tree holds it once.
      list_items: translate linen's list names (``h_0``) to ``ModuleList``'s (``h.0``); where
        torch's names are given and hold the literal ``h_0`` instead, that one is taken.
    """

    rules: tuple[Rule, ...] = FLAX_RULES
    renames: tuple[tuple[str, str], ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    list_items: bool = True

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "renames", tuple((str(j), str(t)) for j, t in dict(self.renames).items()))
        object.__setattr__(self, "tied", tuple((str(a), str(s)) for a, s in dict(self.tied).items()))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise TypeError(f"rules must be Rule objects, got {r!r}")

    @classmethod
    def flax(cls, rules: Sequence[Rule] = (), *, renames: Mapping[str, str] | None = None,
             tied: Mapping[str, str] | None = None) -> "ParamMapping":
        """flax linen's built-in rules (Dense, Conv, Embed, norms, bias), after the user's ``rules``.

        Args:
          rules: rules for your own modules; tried before the built-in ones, so they also override.
          renames: ``{jax segment: torch segment}`` for modules named differently on the two sides.
          tied: ``{torch alias: torch source}``, e.g. ``{"lm_head.weight": "wte.weight"}``.

        >>> m = ParamMapping.flax(renames={"attention": "attn"})
        >>> m.pair({"h_0.attention.query.kernel": (4, 4)}).torch_names
        ('h.0.attn.query.weight',)
        """
        return cls(tuple(rules) + FLAX_RULES, tuple((renames or {}).items()), tuple((tied or {}).items()))

    def _torch_candidates(self, rule: Rule, fields: dict[str, str]) -> list[str]:
        """Every torch name the rule gives: the list-item convention first, the literal name second."""
        options, renamed = {}, dict(self.renames)
        for field, value in fields.items():
            per_segment = []
            for segment in value.split("."):
                if segment in renamed:  # verbatim: renames={"ln_1": "ln_1"} keeps a name off the list convention
                    per_segment.append([renamed[segment]])
                    continue
                m = _LIST_ITEM.match(segment) if self.list_items else None
                per_segment.append([f"{m.group(1)}.{m.group(2)}", segment] if m else [segment])
            options[field] = [".".join(c) for c in itertools.product(*per_segment)]
        names = [rule.torch.format(**dict(zip(options, combo))) for combo in itertools.product(*options.values())]
        return list(dict.fromkeys(names))

    def _torch_spelling(self, name: str, shape: tuple[int, ...]) -> str:
        """The torch name the first matching rule gives ``name`` (or its list names in torch's
        spelling): how JAX names are compared with torch's in messages."""
        for rule in self.rules:
            fields = rule.match(name, len(shape))
            if fields is not None:
                return self._torch_candidates(rule, fields)[0]
        return _torchish(name)

    def _place(self, name: str, shape: tuple[int, ...], torch: dict | None) -> Pair:
        for rule in self.rules:
            fields = rule.match(name, len(shape))
            if fields is None:
                continue
            try:
                torch_shape = rule.layout.torch_shape(shape)
            except ValueError as e:
                raise MappingError(f"jax tensor {name!r} of shape {shape}: rule {rule.label()!r} matches it, but "
                                   f"its layout does not fit: {e}") from None
            candidates = self._torch_candidates(rule, fields)
            if torch is None:
                return Pair(name, candidates[0], rule.layout, shape, torch_shape, rule.label(), rule.grads_together)
            found = [c for c in candidates if c in torch]
            if len(found) > 1:
                raise MappingError(f"jax tensor {name!r}: rule {rule.label()!r} could mean any of the torch tensors "
                                   f"{found}; add a rule or a rename that names one")
            if not found:
                raise MappingError(f"jax tensor {name!r}: rule {rule.label()!r} names it {candidates[0]!r} on the "
                                   f"torch side, and torch has no such tensor ({nearest(candidates[0], list(torch))})")
            if torch[found[0]] != torch_shape:
                raise MappingError(f"jax tensor {name!r} of shape {shape}: rule {rule.label()!r} makes it torch "
                                   f"shape {torch_shape}, but torch's {found[0]!r} has shape {torch[found[0]]}: "
                                   f"add a rule for this module")
            return Pair(name, found[0], rule.layout, shape, torch_shape, rule.label(), rule.grads_together)
        near = f" ({nearest(_torchish(name), list(torch))})" if torch else ""
        if name.endswith(".value"):  # flax NNX keeps a variable's array under .value
            raise MappingError(f"jax tensor {name!r} of shape {shape} matches no rule{near}: a flax NNX "
                               f"variable's array is named by its variable, {name[:-len('.value')]!r} (as "
                               f"hybrid.jax.specs and nnx.to_pure_dict name it); drop the '.value'")
        raise MappingError(f"jax tensor {name!r} of shape {shape} matches no rule{near}: add a Rule for its module")

    def pair(self, jax, torch=None) -> ParamPairing:
        """Place every JAX tensor on the torch side: a :class:`ParamPairing`.

        Args:
          jax: the JAX tensors: ``{name: shape or array}`` (names as :func:`hybrid.jax.specs`
            gives them, e.g. of ``variables["params"]``) or a sequence of TensorSpecs.
          torch: the torch tensors the same way (``named_parameters()``'s names; a ``state_dict``'s
            tied aliases are recognised). Without them torch's names are derived from the rules,
            and the pairing follows the JAX order; with them it follows torch's order.

        Raises:
          MappingError: naming every tensor that cannot be placed, with the nearest names.

        >>> m = ParamMapping.flax(tied={"head.weight": "wte.weight"})
        >>> pairing = m.pair({"wte.embedding": (10, 4), "ln.scale": (4,)},
        ...                  {"wte.weight": (10, 4), "ln.weight": (4,), "head.weight": (10, 4)})
        >>> pairing.torch_names, pairing.tied
        (('wte.weight', 'ln.weight'), (('head.weight', 'wte.weight'),))
        >>> m.pair({"wte.embedding": (10, 4), "ln_f.scale": (4,)}, {"wte.weight": (10, 4), "lnf.weight": (4,)})
        Traceback (most recent call last):
        ...
        hybrid.core.MappingError: 2 tensors cannot be placed:
          jax tensor 'ln_f.scale': rule 'flax norm scale / torch norm weight (LayerNorm, GroupNorm, ...)' names it 'ln_f.weight' on the torch side, and torch has no such tensor (nearest: 'lnf.weight', 'wte.weight')
          torch tensor 'lnf.weight' has no jax counterpart (nearest: 'ln_f.scale', 'wte.embedding')
        """
        jax_shapes = _shapes(jax)
        torch_shapes = None if torch is None else _shapes(torch)
        pairs, errors = [], []
        for name, shape in jax_shapes.items():
            try:
                pairs.append(self._place(name, shape, torch_shapes))
            except MappingError as e:
                errors.append(str(e))
        tied = [(a, s) for a, s in self.tied if torch_shapes is None or a in torch_shapes or s in torch_shapes]
        if torch_shapes is not None:
            placed = {p.torch for p in pairs} | {a for a, _ in tied}
            spelled = {self._torch_spelling(n, s): n for n, s in jax_shapes.items()}
            errors += [f"torch tensor {n!r} has no jax counterpart ({nearest(n, spelled)})"
                       for n in torch_shapes if n not in placed]
            for alias, source in tied:
                if alias in torch_shapes and source in torch_shapes and torch_shapes[alias] != torch_shapes[source]:
                    errors.append(f"tied {alias!r} has shape {torch_shapes[alias]}, its source {source!r} "
                                  f"{torch_shapes[source]}")
            order = {n: i for i, n in enumerate(torch_shapes)}
            pairs.sort(key=lambda p: order.get(p.torch, len(order)))
        if errors:
            raise MappingError(errors_message(errors, "tensors cannot be placed"))
        return ParamPairing(tuple(pairs), tuple(tied))

    def to_json(self) -> dict:
        return {"kind": "ParamMapping", "rules": [r.to_json() for r in self.rules],
                "renames": [list(r) for r in self.renames], "tied": [list(t) for t in self.tied],
                "list_items": self.list_items}

    @classmethod
    def from_json(cls, d: dict) -> "ParamMapping":
        if d.get("kind") != "ParamMapping":
            raise ValueError(f"not a ParamMapping JSON object (kind={d.get('kind')!r})")
        return cls(tuple(Rule.from_json(r) for r in d["rules"]), tuple(map(tuple, d["renames"])),
                   tuple(map(tuple, d["tied"])), d.get("list_items", True))
