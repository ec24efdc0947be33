"""What a parity run is made of, framework-free: the optimizer both sides build, the factories,
the global batches and each rank's rows of them.

Nothing here imports torch or JAX at module level: a spawned torch rank imports this module
without JAX, and the JAX side without torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pickle
from collections.abc import Callable

import numpy as np

OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclasses.dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """One optimizer, built as ``torch.optim`` on the torch side and as optax on the JAX side.

    Args:
      name: ``"sgd"`` (``torch.optim.SGD``; optax's ``trace`` for momentum), ``"adam"``
        (``torch.optim.Adam``: weight decay is an L2 term added to the gradient) or ``"adamw"``
        (``torch.optim.AdamW``: decoupled weight decay, optax's ``adamw``).
      lr, weight_decay: both sides'; ``betas``, ``eps`` for adam/adamw, ``momentum`` for sgd.

    The optax side is :func:`hybrid.checkpoint.jax._optax_groups.optax_from_param_groups` of
    :meth:`torch_group`, the transform that continues a torch checkpoint of this optimizer.

    >>> OptimizerSpec("adamw", lr=1e-3, weight_decay=0.1).torch_group()
    {'lr': 0.001, 'betas': (0.9, 0.999), 'eps': 1e-08, 'weight_decay': 0.1}
    >>> OptimizerSpec("adam", momentum=0.9)
    Traceback (most recent call last):
    ...
    ValueError: momentum=0.9 is sgd's; optimizer 'adam' has betas
    """

    name: str = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}")
        _finite("lr", self.lr, positive=True)
        _finite("eps", self.eps, positive=True)
        _finite("weight_decay", self.weight_decay)
        if len(self.betas) != 2 or not all(0 <= _finite("betas", b) < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not 0 <= _finite("momentum", self.momentum) < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if self.momentum and self.name != "sgd":
            raise ValueError(f"momentum={self.momentum!r} is sgd's; optimizer {self.name!r} has betas")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    def torch_group(self) -> dict:
        """The keyword arguments of the torch optimizer (also one torch param group)."""
        if self.name == "sgd":
            return dict(lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def torch_class(self):
        """``torch.optim.SGD``, ``Adam`` or ``AdamW``."""
        import torch
        return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[self.name]

    def optax(self, params):
        """The optax transform that computes what :meth:`torch_class` computes."""
        from hybrid.checkpoint.jax._optax_groups import optax_from_param_groups
        return optax_from_param_groups(self.name, [self.torch_group()], params, where="OptimizerSpec")

    @property
    def stateful(self) -> bool:
        """Whether the optimizer keeps state (moments, momentum) that a checkpoint carries."""
        return self.name != "sgd" or self.momentum > 0


def _finite(name: str, value, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'positive' if positive else 'non-negative'}, got {value!r}")
    return float(value)


def count(name: str, value, *, least: int = 1) -> int:
    """``value`` as an int of at least ``least``, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


# ---- factories ------------------------------------------------------------------------------

def load_reference(reference: str, what: str):
    """The object a ``"pkg.module:name"`` reference names (``name`` may be dotted).

    >>> load_reference("hybrid.parity._spec:OPTIMIZERS", "optimizers")
    ('sgd', 'adam', 'adamw')
    >>> load_reference("hybrid.parity._spec", "torch factory")
    Traceback (most recent call last):
    ...
    ValueError: torch factory 'hybrid.parity._spec' must be 'pkg.module:name'
    """
    module, _, name = reference.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {reference!r} must be 'pkg.module:name'")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{what} {reference!r}: cannot import {module!r}: {e}") from e
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {reference!r}: {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def load_factory(factory, what: str) -> Callable:
    """``factory`` itself (a callable) or the callable a ``"pkg.mod:name"`` reference names."""
    if callable(factory):
        return factory
    if not isinstance(factory, str):
        raise TypeError(f"{what} must be a callable or a 'pkg.module:name' string, got {type(factory).__name__}")
    obj = load_reference(factory, what)
    if not callable(obj):
        raise TypeError(f"{what} {factory!r} is a {type(obj).__name__}, not a callable")
    return obj


def portable(factory):
    """``factory`` as it can travel to a spawned process: a ``"pkg.mod:name"`` string or a callable
    pickle finds by name as they are; anything else (a lambda, a closure, a function of a script
    or notebook's ``__main__``) as cloudpickle's bytes, unpickled by :func:`load_factory_any`."""
    if isinstance(factory, str):
        return factory
    if getattr(factory, "__module__", "__main__") != "__main__":
        try:
            pickle.dumps(factory)
            return factory
        except (pickle.PicklingError, AttributeError, TypeError):
            pass
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - the parity extra installs it
        raise TypeError(f"the torch factory {factory!r} is not importable by name (defined in __main__, a lambda "
                        f"or a closure): spawned torch ranks cannot find it. Define it at module level in an "
                        f"importable module, or install cloudpickle (the 'parity' extra)") from None
    return cloudpickle.dumps(factory)


def load_factory_any(factory, what: str) -> Callable:
    """:func:`load_factory` of what :func:`portable` made."""
    if isinstance(factory, bytes):
        import cloudpickle
        return cloudpickle.loads(factory)
    return load_factory(factory, what)


def check_torch_loss(loss):
    """``loss`` if it is what the torch loss_fn must return, a scalar tensor; else a TypeError saying
    what it is (the same message here, where ``prepare`` observes torch's order, and on the ranks).

    >>> import torch
    >>> check_torch_loss(torch.ones(8, 1))
    Traceback (most recent call last):
    ...
    TypeError: the torch loss_fn must return a scalar tensor, got Tensor (8, 1)
    """
    import torch
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
        raise TypeError(f"the torch loss_fn must return a scalar tensor, got {type(loss).__name__} "
                        f"{tuple(getattr(loss, 'shape', ()))}")
    return loss


def pair_of(factory, what: str) -> tuple:
    """Call a factory; it must return ``(model, loss_fn)`` with a callable loss."""
    made = load_factory_any(factory, f"the {what} factory")()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[1])):
        raise TypeError(f"the {what} factory must return (model, loss_fn), got {type(made).__name__}"
                        + (f" of {len(made)}" if isinstance(made, tuple) else ""))
    return made


# ---- data -----------------------------------------------------------------------------------

def tree_map(fn, tree):
    """``fn`` on every array of a batch (an array, or dicts, lists and tuples of them)."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v) for v in tree)
    return fn(tree)


def _leaves(tree) -> list:
    out = []
    tree_map(out.append, tree)
    return out


def global_batches(data, steps: int) -> tuple:
    """The first ``steps`` global batches of ``data`` as numpy: ``data(step)`` for a callable, else
    the first ``steps`` items of an iterable. Every array of a batch has the same number of rows
    (its leading axis).

    >>> [b[0].shape for b in global_batches(lambda i: (np.full((4, 2), i), np.arange(4)), 2)]
    [(4, 2), (4, 2)]
    >>> global_batches(lambda i: (np.zeros((3, 2)), np.zeros(4)), 1)
    Traceback (most recent call last):
    ...
    ValueError: batch 0: every array must have the same number of rows (leading axis), got shapes [(3, 2), (4,)]
    """
    if callable(data):
        items = [data(i) for i in range(steps)]
    else:
        items, it = [], iter(data)
        for i in range(steps):
            try:
                items.append(next(it))
            except StopIteration:
                raise ValueError(f"the data source ended after {i} batches; {steps} steps need {steps}") from None
    out = []
    for i, batch in enumerate(items):
        batch = tree_map(np.asarray, batch)
        rows = {a.shape[0] if a.ndim else None for a in _leaves(batch)}
        if not rows or None in rows or len(rows) != 1:
            raise ValueError(f"batch {i}: every array must have the same number of rows (leading axis), got "
                             f"shapes {[a.shape for a in _leaves(batch)]}")
        out.append(batch)
    return tuple(out)


def check_split(batches, n: int, who: str) -> None:
    """Every batch's rows split evenly over ``n`` ranks or devices, or a ValueError.

    >>> check_split([np.zeros((6, 2))], 4, "the torch side's 4 ranks")
    Traceback (most recent call last):
    ...
    ValueError: batch 0 has 6 rows, which the torch side's 4 ranks cannot split evenly
    """
    for i, batch in enumerate(batches):
        rows = _leaves(batch)[0].shape[0]
        if rows % n:
            raise ValueError(f"batch {i} has {rows} rows, which {who} cannot split evenly")


def rank_rows(batch, rank: int, world_size: int):
    """Rank ``rank``'s rows of every array, ``[r * B / W, (r + 1) * B / W)``: DDP's usual split,
    and what a ``P("dp")`` sharding gives device ``r``.

    >>> rank_rows({"x": np.arange(6)}, 1, 3)["x"].tolist()
    [2, 3]
    """
    def rows(a):
        k = a.shape[0] // world_size
        return a[rank * k:(rank + 1) * k]
    return tree_map(rows, batch)
