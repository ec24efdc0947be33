"""A resolved mapping: every tensor of a JAX tree paired with its torch name and layout.

:class:`ParamPairing` is what :meth:`hybrid.core.ParamMapping.pair` returns. It is plain data
(names, shapes, layouts), JSON round-trippable with a fingerprint like every plan, and it converts
whole parameter sets both ways, exactly: nothing is dropped, invented or silently skipped.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from hybrid.core._fingerprint import fingerprint_of
from hybrid.core.mapping._layout import Layout


class MappingError(ValueError):
    """A tensor the mapping cannot place, or arrays that do not fit the pairing; the message names it."""

    __module__ = "hybrid.core"  # raised to users as the public name


def nearest(name: str, candidates: Iterable[str] | Mapping[str, str], n: int = 3) -> str:
    """``name``'s closest candidates (difflib), for messages. From a mapping, the keys are compared
    and the values named (e.g. JAX names compared in torch's spelling).

    >>> nearest("h.0.attn.c_atn.weight", ["h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "wte.weight"])
    "nearest: 'h.0.attn.c_attn.weight', 'h.0.mlp.c_fc.weight'"
    """
    shown = dict(candidates) if isinstance(candidates, Mapping) else {c: c for c in candidates}
    close = difflib.get_close_matches(name, list(shown), n=n, cutoff=0.6)
    return "nearest: " + ", ".join(repr(shown[c]) for c in close) if close else "no similar names"


def errors_message(errors: list[str], what: str) -> str:
    """One error as it is; several as a count and one per line."""
    return errors[0] if len(errors) == 1 else f"{len(errors)} {what}:\n  " + "\n  ".join(errors)


@dataclasses.dataclass(frozen=True, slots=True)
class Pair:
    """One tensor on both sides: JAX name and shape, torch name and shape, the layout between
    them (JAX to torch), the rule that placed it (for messages and the plan inspector), and
    whether torch computes its module's gradients in one backward node (``Rule.grads_together``:
    None leaves it to :meth:`ParamPairing.torch_ready_order`, which says yes for norm-like modules)."""

    jax: str
    torch: str
    layout: Layout
    jax_shape: tuple[int, ...]
    torch_shape: tuple[int, ...]
    rule: str = ""
    grads_together: bool | None = None

    def to_json(self) -> dict:
        return {"jax": self.jax, "torch": self.torch, "layout": self.layout.to_json(),
                "jax_shape": list(self.jax_shape), "torch_shape": list(self.torch_shape), "rule": self.rule,
                "grads_together": self.grads_together}

    @classmethod
    def from_json(cls, d: dict) -> "Pair":
        return cls(d["jax"], d["torch"], Layout.from_json(d["layout"]), tuple(d["jax_shape"]),
                   tuple(d["torch_shape"]), d.get("rule", ""), d.get("grads_together"))


def _host(x) -> np.ndarray:
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)


@dataclasses.dataclass(frozen=True, slots=True)
class ParamPairing:
    """Each JAX tensor with its torch counterpart, in torch's order where torch's names were given.

    Args:
      pairs: one :class:`Pair` per tensor.
      tied: ``(alias, source)`` torch names: ``alias`` is the same tensor as ``source`` (an LM head
        tied to the token embedding). torch's ``named_parameters()`` lists it once, its
        ``state_dict()`` under both names; the JAX tree holds it once.
      torch_ready: torch's names in the order torch's own backward made their gradients ready, as
        observed on one step (:func:`hybrid.torch.gradient_ready_order`; :meth:`with_torch_ready`);
        empty where no torch step was observed, and :meth:`torch_ready_order` infers the order.

    >>> from hybrid.core import ParamMapping
    >>> pairing = ParamMapping.flax().pair({"fc.kernel": (3, 5), "fc.bias": (5,)})
    >>> [(p.jax, p.torch, str(p.layout)) for p in pairing.pairs]
    [('fc.kernel', 'fc.weight', 'transpose(1, 0)'), ('fc.bias', 'fc.bias', 'as is')]
    >>> ParamPairing.from_json(pairing.dumps()).fingerprint() == pairing.fingerprint()
    True
    """

    pairs: tuple[Pair, ...]
    tied: tuple[tuple[str, str], ...] = ()
    torch_ready: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "pairs", tuple(self.pairs))
        object.__setattr__(self, "tied", tuple((str(a), str(s)) for a, s in self.tied))
        object.__setattr__(self, "torch_ready", tuple(str(n) for n in self.torch_ready))
        for side in ("jax", "torch"):
            names = [getattr(p, side) for p in self.pairs]
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise MappingError(f"{side} names placed more than once: {twice}")
        torch_names = {p.torch for p in self.pairs}
        for alias, source in self.tied:
            if source not in torch_names:
                raise MappingError(f"tied {alias!r} -> {source!r}: {source!r} is no torch tensor of the pairing "
                                   f"({nearest(source, torch_names)})")
            if alias in torch_names:
                raise MappingError(f"tied {alias!r} -> {source!r}: {alias!r} is a tensor of its own in the pairing")
        unknown = [n for n in self.torch_ready if n not in torch_names]
        if unknown or len(set(self.torch_ready)) != len(self.torch_ready):
            raise MappingError(f"torch_ready must name torch tensors of the pairing at most once; unknown: "
                               f"{[f'{n} ({nearest(n, torch_names)})' for n in unknown]}")

    @property
    def jax_names(self) -> tuple[str, ...]:
        return tuple(p.jax for p in self.pairs)

    @property
    def torch_names(self) -> tuple[str, ...]:
        """torch names in pairing order (torch's registration order when torch's names were given)."""
        return tuple(p.torch for p in self.pairs)

    def torch_name(self, jax_name: str) -> str:
        return self._by("jax", jax_name).torch

    def jax_name(self, torch_name: str) -> str:
        return self._by("torch", dict(self.tied).get(torch_name, torch_name)).jax

    def _by(self, side: str, name: str) -> Pair:
        for p in self.pairs:
            if getattr(p, side) == name:
                return p
        raise MappingError(f"no {side} tensor {name!r} in the pairing ({nearest(name, self._names(side))})")

    def _names(self, side: str) -> list[str]:
        return [getattr(p, side) for p in self.pairs] + ([a for a, _ in self.tied] if side == "torch" else [])

    def _check_keys(self, arrays: Mapping, side: str, optional: Iterable[str] = ()) -> None:
        wanted = [getattr(p, side) for p in self.pairs]
        missing = [n for n in wanted if n not in arrays]
        unknown = [n for n in arrays if n not in set(wanted) | set(optional)]
        if missing or unknown:
            lines = [f"{side} tensor {n!r} has no place in the pairing ({nearest(n, wanted)})" for n in unknown]
            lines += [f"{side} tensor {n!r} is missing ({nearest(n, list(arrays))} among those given)"
                      for n in missing]
            raise MappingError(errors_message(lines, "tensors do not fit the pairing"))

    def to_torch(self, jax_arrays: Mapping, *, tied: bool = False) -> dict:
        """The torch-named, torch-laid-out arrays of ``{jax name: array}``, in pairing order.

        With ``tied=True`` each tied alias is added after its source as the same array (the keys
        of torch's ``state_dict()``); by default only the tensors ``named_parameters()`` lists.
        """
        self._check_keys(jax_arrays, "jax")
        out = {}
        for p in self.pairs:
            x = jax_arrays[p.jax]
            if tuple(x.shape) != p.jax_shape:
                raise MappingError(f"jax tensor {p.jax!r} has shape {tuple(x.shape)}, the pairing {p.jax_shape}")
            out[p.torch] = p.layout.to_torch(x)
        if tied:
            for alias, source in self.tied:
                out[alias] = out[source]
        return out

    def to_jax(self, torch_arrays: Mapping) -> dict:
        """The JAX-named, JAX-laid-out arrays of ``{torch name: array}``, in pairing order.

        Tied aliases may be given (a ``state_dict``): each must hold exactly its source's values.
        """
        self._check_keys(torch_arrays, "torch", optional=[a for a, _ in self.tied])
        for alias, source in self.tied:
            a = torch_arrays.get(alias)
            if a is not None and a is not torch_arrays[source] and not np.array_equal(_host(a), _host(torch_arrays[source])):
                raise MappingError(f"torch tensor {alias!r} is tied to {source!r} but holds other values")
        out = {}
        for p in self.pairs:
            y = torch_arrays[p.torch]
            if tuple(y.shape) != p.torch_shape:
                raise MappingError(f"torch tensor {p.torch!r} has shape {tuple(y.shape)}, the pairing {p.torch_shape}")
            out[p.jax] = p.layout.to_jax(y, p.jax_shape)
        return out

    def to_json(self) -> dict:
        out = {"kind": "ParamPairing", "pairs": [p.to_json() for p in self.pairs], "tied": [list(t) for t in self.tied]}
        if self.torch_ready:  # written only where observed: pairings without one keep their fingerprints
            out["torch_ready"] = list(self.torch_ready)
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def from_json(cls, d: dict | str) -> "ParamPairing":
        if isinstance(d, str):
            d = json.loads(d)
        if d.get("kind") != "ParamPairing":
            raise ValueError(f"not a ParamPairing JSON object (kind={d.get('kind')!r})")
        return cls(tuple(Pair.from_json(p) for p in d["pairs"]), tuple(tuple(t) for t in d.get("tied", ())),
                   tuple(d.get("torch_ready", ())))

    def fingerprint(self) -> str:
        """Stable 16-hex-digit digest: equal pairings give equal strings in every process."""
        return fingerprint_of(self.to_json())

    def with_torch_ready(self, order: Sequence[str]) -> "ParamPairing":
        """This pairing, planning in ``order``: torch's names as torch's own backward made their
        gradients ready (:func:`hybrid.torch.gradient_ready_order` of the torch module on a batch).

        Where the torch half is at hand this is the truth :meth:`torch_ready_order` otherwise
        infers from JAX's backward and the rules. A tied alias counts as its source (torch's
        ``named_parameters()`` lists the source).

        >>> from hybrid.core import ParamMapping
        >>> pairing = ParamMapping.flax().pair({"fc.kernel": (4, 2), "fc.bias": (2,)})
        >>> pairing.with_torch_ready(["fc.weight", "fc.bias"]).torch_ready_order(["fc.bias", "fc.kernel"])
        ('fc.weight', 'fc.bias')
        """
        tied = dict(self.tied)
        return dataclasses.replace(self, torch_ready=tuple(tied.get(n, n) for n in order))

    def computed_together(self) -> dict[str, str]:
        """``{torch module: why}`` for each module whose gradients torch computes in one backward
        node and accumulates in registration order (weight before bias), where JAX's backward
        computes them apart: ``"rule"`` where a rule says so (``grads_together=True``), ``"norm-like"``
        where no rule says either way and the module holds exactly a 1-D ``weight`` and a ``bias`` of
        its shape (LayerNorm, GroupNorm, BatchNorm, RMSNorm with a bias: their backward nodes
        compute both at once).

        >>> from hybrid.core import ParamMapping, Rule
        >>> mine = ParamMapping((Rule("{m}.g", "{m}.weight"), Rule("{m}.b", "{m}.bias")))  # no grads_together
        >>> mine.pair({"ln1.g": (8,), "ln1.b": (8,)}).computed_together()
        {'ln1': 'norm-like'}
        """
        out = {}
        for module, pairs in self._modules().items():
            said = {p.grads_together for p in pairs} - {None}
            if True in said:
                out[module] = "rule"
            elif not said and _norm_like(pairs):
                out[module] = "norm-like"
        return out

    def _modules(self) -> dict[str, list[Pair]]:
        modules: dict[str, list[Pair]] = {}
        for p in self.pairs:  # torch's registration order within each module
            modules.setdefault(p.torch.rpartition(".")[0], []).append(p)
        return modules

    def torch_ready_order(self, jax_ready: Sequence[str]) -> tuple[str, ...]:
        """torch's names in the order torch's autograd makes their gradients ready, from the order
        JAX's backward computes them (:func:`hybrid.jax.gradient_ready_order`).

        Where torch's own order was observed (:meth:`with_torch_ready`) it is that order, over the
        tensors JAX computes gradients for (any that torch's step left without one follow, as
        below). Otherwise it is inferred: the two backward passes walk the modules in the same
        order; inside one module they can differ. torch accumulates the gradients a single
        backward node computes in the node's argument order, and its convolutions and norms
        compute weight and bias in one node (weight first), where JAX's backward sums the bias's
        gradient before the weight's. So the tensors of a module :meth:`computed_together` names
        (a ``grads_together`` rule, or a norm-like module no rule speaks for) are emitted
        together, in torch's registration order, where the module's first gradient is ready in
        JAX. A Linear's bias is ready before its weight in both (torch reaches the weight through
        a transpose).

        >>> from hybrid.core import ParamMapping
        >>> pairing = ParamMapping.flax().pair({"ln.scale": (4,), "ln.bias": (4,), "fc.kernel": (4, 2), "fc.bias": (2,)},
        ...                                    {"ln.weight": (4,), "ln.bias": (4,), "fc.weight": (2, 4), "fc.bias": (2,)})
        >>> pairing.torch_ready_order(["fc.bias", "fc.kernel", "ln.bias", "ln.scale"])
        ('fc.bias', 'fc.weight', 'ln.weight', 'ln.bias')
        """
        jax_ready = list(jax_ready)
        by_jax = {p.jax: p for p in self.pairs}
        unknown = [n for n in jax_ready if n not in by_jax]
        if unknown or len(set(jax_ready)) != len(jax_ready):
            raise MappingError(f"jax_ready must name tensors of the pairing at most once; unknown: "
                               f"{[f'{n} ({nearest(n, list(by_jax))})' for n in unknown]}")
        wanted = {by_jax[n].torch for n in jax_ready}
        out = [n for n in self.torch_ready if n in wanted]
        done = set(out)
        modules, together = self._modules(), self.computed_together()
        for name in jax_ready:
            p = by_jax[name]
            module = p.torch.rpartition(".")[0]
            for q in [q for q in modules[module] if q.jax in jax_ready] if module in together else [p]:
                if q.torch not in done:
                    done.add(q.torch)
                    out.append(q.torch)
        return tuple(out)


def _norm_like(pairs: list[Pair]) -> bool:
    """A module of exactly a 1-D ``weight`` and a ``bias`` of the same shape (torch's names)."""
    shapes = {p.torch.rpartition(".")[2]: p.torch_shape for p in pairs}
    return set(shapes) == {"weight", "bias"} and len(shapes["weight"]) == 1 and shapes["weight"] == shapes["bias"]
