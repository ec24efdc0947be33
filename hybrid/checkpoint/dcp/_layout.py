"""Which entries of a DCP checkpoint are the model's, the optimizer's and the training step.

``dcp.save`` flattens the nested state dict it is given and records, in the metadata's
``planner_data``, each flat key's path in it: ``("model", "0.weight")``, ``("optim", "state",
"0.weight", "exp_avg")``, ``("optim", "param_groups", 0, "lr")``. That is what
``get_state_dict(model, optimizer)`` gives, under whatever keys the run chose (``{"model":,
"optim":}`` as in torch's recipe, ``{"app": AppState}``, torchtitan's model keys at the top and
``"optimizer"`` flattened with ``flatten_optimizer_state_dict``: ``("optimizer",
"state.0.weight.exp_avg")``). The optimizer is found where its param groups are; the model is
the prefix under which every parameter the optimizer steps is a tensor; the training step is an
entry named ``step`` outside both. Everything else (an LR scheduler, data-loader state, a train
state, ...) is listed as the rest, which the reader carries (``hybrid.checkpoint._other_state``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

from hybrid.checkpoint._manifest import CheckpointError

Path = tuple  # a flat key's path in the saved nested state dict


@dataclasses.dataclass(frozen=True)
class DcpLayout:
    """The roles of a DCP checkpoint's entries (flat keys of its metadata)."""

    model: dict[str, str]                # parameter name -> key
    buffers: dict[str, str]              # buffer name -> key
    state: dict[str, dict[str, str]]     # parameter name -> {torch state key ("exp_avg", "step"): key}
    groups: list[dict]                   # each param group's hyperparameters, with "param_names"
    step_keys: tuple[str, ...]           # entries named "step" outside the model and the optimizer
    left_out: tuple[str, ...]            # entries none of the above
    paths: dict = dataclasses.field(default_factory=dict)  # every key's path in the saved nested dict
    model_prefix: Path = ()                # the model's entries lie under it ((): the top level, torchtitan's)
    optim_prefix: Path | None = None       # the optimizer's; None: no optimizer
    optim_flat: bool = False               # flatten_optimizer_state_dict's keys (torchtitan's), not nested

    def writes_as(self) -> dict:
        """How a DCP written back lays the model and optimizer out, as this one does (JSON)."""
        return {"model_key": ".".join(map(str, self.model_prefix)),
                "optim_key": None if self.optim_prefix is None else ".".join(map(str, self.optim_prefix)),
                "optim_flat": self.optim_flat}


def _optimizer_entry(path: Path):
    """``("state", prefix, name, key)``, ``("group", prefix, group, key)`` (nested: group index;
    flattened: parameter name) or None."""
    if len(path) >= 3 and path[-3] == "state" and isinstance(path[-2], str):
        return "state", path[:-3], path[-2], path[-1]
    if len(path) >= 3 and path[-3] == "param_groups" and isinstance(path[-2], int):
        return "group", path[:-3], path[-2], path[-1]
    last = path[-1] if path else None
    for marker, role in (("state.", "state"), ("param_groups.", "flat_group")):
        if isinstance(last, str) and last.startswith(marker) and "." in last[len(marker):]:
            name, key = last[len(marker):].rsplit(".", 1)
            return role, path[:-1], name, key
    return None


def _dotted(prefix: Path) -> str:
    return ".".join(map(str, prefix)) or "(the top level)"


def classify(keys: Sequence[str], paths: dict | None, is_tensor: Callable[[str], bool],
             load_value: Callable[[str], object], *, where: str, param_names: Sequence[str] | None = None,
             model_key: str | None = None) -> DcpLayout:
    """The roles of ``keys`` (the metadata's flat keys, in saved order).

    Args:
      paths: the metadata's ``planner_data`` (flat key -> path), None if the saver kept none.
      is_tensor: whether a key holds a tensor (else pickled bytes).
      load_value: a bytes entry's value (a param group's ``lr``, its ``params``).
      param_names: the receiving model's parameter names, where known: they are the model's
        parameters even if the optimizer does not step them; the other model tensors are buffers.
      model_key: the model's prefix ("model", "app.model"; "" for the top level), if not found.
    """
    if paths is None:
        if any(_optimizer_entry(tuple(k.split("."))) for k in keys):
            raise CheckpointError(f"{where}: saved without the planner's record of each key's path (planner_data), "
                                  f"so the model's names cannot be told from the optimizer's: save with torch's "
                                  f"DefaultSavePlanner (dcp.save's default)")
        paths = {k: (k,) for k in keys}
    path_of = {k: tuple(paths.get(k, (k,))) for k in keys}
    optimizer = {k: e for k in keys if (e := _optimizer_entry(path_of[k])) is not None}
    prefixes = {e[1] for e in optimizer.values() if e[0] in ("group", "flat_group")}
    if len(prefixes) > 1:
        raise CheckpointError(f"{where}: holds several optimizers' states (under {sorted(map(_dotted, prefixes))}); "
                              f"hybrid reads one")
    opt_prefix = next(iter(prefixes), None)
    mine = {k: e for k, e in optimizer.items() if e[1] == opt_prefix}
    state: dict[str, dict[str, str]] = {}
    for k, (role, _, name, key) in mine.items():
        if role == "state":
            state.setdefault(name, {})[key] = k
    groups = _groups(mine, load_value, where)
    stepped = [n for g in groups for n in g["param_names"]]
    rest = [k for k in keys if k not in mine]
    model_prefix = _model_prefix(rest, path_of, is_tensor, stepped or list(state), param_names, model_key, where)
    model, buffers, left_out, step_keys = {}, {}, [], []
    known = set(param_names) if param_names is not None else set(stepped) | set(state)
    for k in rest:
        path = path_of[k]
        if path and path[-1] == "step" and path[-1] not in known:  # a run's step, even beside model keys
            step_keys.append(k)
        elif path[:-1] == model_prefix and isinstance(path[-1], str) and is_tensor(k):
            name = path[-1]
            (model if (name in known or not known) else buffers)[name] = k
        else:
            left_out.append(k)
    missing = [n for n in stepped if n not in model]
    if missing:
        raise CheckpointError(f"{where}: the optimizer steps {missing}, which the model's entries (under "
                              f"{_dotted(model_prefix)}) lack")
    flat = any(isinstance(path_of[k][-1], str) and path_of[k][-1].startswith(("state.", "param_groups."))
               for k in mine)
    return DcpLayout(model, buffers, state, groups, tuple(step_keys), tuple(left_out), path_of, model_prefix,
                     opt_prefix, flat)


def _groups(entries: dict, load_value, where: str) -> list[dict]:
    """The param groups, with ``param_names``: nested (``param_groups.0.lr``, ``.params`` the names)
    or flattened per parameter (``param_groups.NAME.lr``: parameters with equal values form a group)."""
    nested: dict[int, dict] = {}
    flat: dict[str, dict] = {}
    for k, (role, _, where_in, key) in entries.items():
        if role == "group":
            nested.setdefault(where_in, {})[key] = load_value(k)
        elif role == "flat_group":
            flat.setdefault(where_in, {})[key] = load_value(k)
    groups = []
    for i in sorted(nested):
        g = dict(nested[i])
        names = g.pop("params", None)
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise CheckpointError(f"{where}: param group {i} lists its parameters as {names!r}, not by name "
                                  f"(save the state dict get_state_dict gives)")
        groups.append({**g, "param_names": list(names)})
    by_values: dict[str, dict] = {}
    for name, values in flat.items():
        values = {k: v for k, v in values.items() if k != "params"}
        key = json.dumps(values, sort_keys=True, default=repr)
        by_values.setdefault(key, {**values, "param_names": []})["param_names"].append(name)
    return groups + list(by_values.values())


def _model_prefix(keys, path_of, is_tensor, names, param_names, model_key, where) -> Path:
    """The prefix of the model's entries: given, or the one under which every parameter is a tensor."""
    by_prefix: dict[Path, set] = {}
    for k in keys:
        path = path_of[k]
        if path and isinstance(path[-1], str) and is_tensor(k):
            by_prefix.setdefault(path[:-1], set()).add(path[-1])
    if model_key is not None:
        prefix = tuple(model_key.split(".")) if model_key else ()
        if prefix not in by_prefix:
            raise CheckpointError(f"{where}: holds no tensors under {model_key!r} (it has {sorted(map(_dotted, by_prefix))})")
        return prefix
    wanted = set(param_names if param_names is not None else names)
    if wanted:
        fits = [p for p, held in by_prefix.items() if wanted <= held]
        if len(fits) == 1:
            return fits[0]
        if not fits:
            best = max(by_prefix, key=lambda p: len(wanted & by_prefix[p]), default=())
            missing = sorted(wanted - by_prefix.get(best, set()))
            raise CheckpointError(f"{where}: no entries hold every parameter of the model; the closest, under "
                                  f"{_dotted(best)}, lack {missing}")
        by_prefix = {p: by_prefix[p] for p in fits}
    if len(by_prefix) == 1:
        return next(iter(by_prefix))
    if ("model",) in by_prefix:
        return ("model",)
    raise CheckpointError(f"{where}: cannot tell which tensors are the model's (they lie under "
                          f"{sorted(map(_dotted, by_prefix))}): pass model_key=")
