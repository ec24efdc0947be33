"""Crossing between a torch module and a JAX parameter tree through a declared mapping.

The mapping itself (:class:`hybrid.core.ParamMapping`) is names and shapes only; these functions
read the names from each framework (torch's ``named_parameters()``, the JAX tree's key paths as
:func:`hybrid.jax.specs` names them), resolve the pairing, and move arrays across.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import torch

from hybrid.core import ParamMapping, ParamPairing
from hybrid.jax._specs import _leaves


def named_torch(module: torch.nn.Module, *, grads: bool = False) -> dict[str, np.ndarray]:
    """``named_parameters()`` (each tied tensor once) as numpy copies; ``grads=True``: their ``.grad``.

    >>> named_torch(torch.nn.Linear(3, 2))["weight"].shape
    (2, 3)
    """
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p
        if t is None:
            raise ValueError(f"parameter {name!r} has no gradient")
        out[name] = t.detach().cpu().numpy().copy()
    return out


def tied_parameters(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: source}`` for parameters registered under several names (an LM head tied to the
    token embedding): ``source`` is the name ``named_parameters()`` keeps.

    >>> m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False)})
    >>> m["head"].weight = m["emb"].weight
    >>> tied_parameters(m)
    {'head.weight': 'emb.weight'}
    """
    first: dict[int, str] = {}
    tied = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def named_jax(tree) -> dict[str, np.ndarray]:
    """A JAX pytree's leaves as numpy arrays named by key path (``h_0.attn.c_attn.kernel``).

    >>> import jax.numpy as jnp
    >>> list(named_jax({"h_0": {"kernel": jnp.ones((2, 3))}}))
    ['h_0.kernel']
    """
    names, leaves, _ = _leaves(tree)
    return {n: np.asarray(x) for n, x in zip(names, leaves)}


def jax_tree(like, named: dict) -> object:
    """``named`` (``{key-path name: array}``) in the structure of ``like``, as JAX arrays of its
    dtypes; every leaf must be given, no more."""
    names, leaves, treedef = _leaves(like)
    if set(names) != set(named):
        raise ValueError(f"arrays named {sorted(set(named) - set(names))} have no leaf in the tree, leaves "
                         f"{sorted(set(names) - set(named))} were not given")
    return jax.tree_util.tree_unflatten(treedef, [jax.numpy.asarray(named[n], dtype=x.dtype)
                                                  for n, x in zip(names, leaves)])


def pair_models(module: torch.nn.Module, params, mapping: ParamMapping | None = None) -> ParamPairing:
    """The pairing of a torch module's parameters with a JAX tree's leaves, in torch's order.

    Args:
      module: the torch model; its tied parameters are found (:func:`tied_parameters`) and added
        to the mapping's.
      params: the JAX parameter tree, e.g. flax's ``variables["params"]`` (arrays or
        ``jax.ShapeDtypeStruct``s: only names and shapes are read).
      mapping: default ``ParamMapping.flax()``, flax linen's built-in rules.

    >>> import jax.numpy as jnp
    >>> model = torch.nn.ModuleDict({"fc": torch.nn.Linear(3, 2)})
    >>> [(p.jax, p.torch) for p in pair_models(model, {"fc": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}}).pairs]
    [('fc.kernel', 'fc.weight'), ('fc.bias', 'fc.bias')]
    """
    mapping = mapping or ParamMapping.flax()
    tied = {**dict(mapping.tied), **tied_parameters(module)}
    mapping = dataclasses.replace(mapping, tied=tuple(tied.items()))
    names, leaves, _ = _leaves(params)
    torch_shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    return mapping.pair(dict(zip(names, (tuple(x.shape) for x in leaves))), torch_shapes)


class _AsWrapped(torch.nn.Module):
    """The bare module as a loss written for the wrapped one sees it: called, or reached through
    ``.module``, as DDP and ZeRO3 are (and with no gradient hooks of its own)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def observed_ready_order(module: torch.nn.Module, loss_fn, batch) -> list[str]:
    """torch's own gradient-ready order of ``module`` on one step of ``loss_fn(wrapped, batch)``
    (the parity harness's loss, written for the DDP-wrapped module); what torch's DDP rebuilds
    its buckets from. ``batch``: torch tensors. See :func:`hybrid.torch.gradient_ready_order`.

    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    >>> observed_ready_order(net, lambda m, x: m(x).sum(), torch.ones(2, 3))
    ['1.weight', '1.bias', '0.bias', '0.weight']
    """
    from hybrid.parity._spec import check_torch_loss
    from hybrid.torch import gradient_ready_order
    return gradient_ready_order(module, lambda m, b: check_torch_loss(loss_fn(_AsWrapped(m), b)), batch)


def torch_to_jax(module: torch.nn.Module, like, mapping: ParamMapping | None = None):
    """The torch module's parameters as a JAX tree in the structure, names and layouts of ``like``.

    >>> import jax.numpy as jnp
    >>> model = torch.nn.ModuleDict({"fc": torch.nn.Linear(3, 2)})
    >>> p = torch_to_jax(model, {"fc": {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(2)}})
    >>> bool((np.asarray(p["fc"]["kernel"]) == model["fc"].weight.detach().numpy().T).all())
    True
    """
    pairing = pair_models(module, like, mapping)
    return jax_tree(like, pairing.to_jax(named_torch(module)))


def jax_to_torch(params, module: torch.nn.Module, mapping: ParamMapping | None = None) -> torch.nn.Module:
    """Copy a JAX tree's leaves into the torch module's parameters (through the mapping); returns it.

    >>> import jax.numpy as jnp
    >>> model = jax_to_torch({"fc": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}},
    ...                      torch.nn.ModuleDict({"fc": torch.nn.Linear(3, 2)}))
    >>> model["fc"].weight.tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    pairing = pair_models(module, params, mapping)
    arrays = pairing.to_torch(named_jax(params))
    own = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in arrays.items():
            own[name].copy_(torch.from_numpy(np.array(value)))  # a writable copy: jax arrays are read-only
    return module
