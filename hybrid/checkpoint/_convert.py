"""``convert(SRC, DST, to=...)``: a checkpoint of any format hybrid reads, written in another.

Everything is read and checked before anything is written (an optimizer hybrid does not know, a
tensor the mapping cannot place, a missing step: refused, naming it, with nothing at DST). The
new checkpoint is written into a hidden sibling (``.DST.converting``) and renamed to DST once
complete, so DST holds a whole checkpoint or nothing; an existing DST is never replaced.

The formats are reached through the registry (``_formats.format_named``): the source's reader
opens it, the target's writer writes it. A format whose writer takes a JAX train state (orbax)
gets it from ``hybrid.checkpoint.jax``, built here, so no format imports the JAX loader (which
opens checkpoints through the registry) or this module. :func:`write_dcp` and :func:`write_orbax`
(exported by ``hybrid.checkpoint.dcp`` and ``hybrid.checkpoint.orbax``) write in place, without
the staging.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Callable

from hybrid.checkpoint._formats import format_named, open_checkpoint, registered
from hybrid.checkpoint._protocol import fs, resolve


@dataclasses.dataclass(frozen=True)
class Converted:
    """What a conversion wrote: the formats, the step, how many tensors and bytes, and the
    source's entries that no format hybrid writes holds (a DCP run's data-loader state, ...)."""

    source_format: str
    format: str
    step: int
    num_tensors: int
    nbytes: int
    left_out: tuple[str, ...]


def _staging(dst: pathlib.Path) -> pathlib.Path:
    return dst.parent / f".{dst.name}.converting"


def convert(src, dst: str | os.PathLike, *, to: str, format: str | None = None, step: int | None = None,
            world_size: int = 1, mapping=None, like=None, param_groups=None,
            progress: Callable[[str], None] | None = None, **options) -> Converted:
    """Write the checkpoint at ``src`` (hybrid, torch DCP or orbax) as a ``to`` checkpoint at ``dst``.

    Args:
      src: a checkpoint directory (its format recognised, or ``format=``), or an opened one.
      dst: where the new checkpoint goes; must not exist.
      to: ``"hybrid"``, ``"dcp"`` (torch's ``dcp.load`` + ``set_state_dict`` read it into an
        FSDP2 model and optimizer) or ``"orbax"`` (``StandardCheckpointer().restore`` gives a
        flax train state ``{"params", "opt_state", "step"}``).
      step: the training step, for a source that records none (an orbax CheckpointManager: the
        step directory to convert).
      world_size: ``to="hybrid"``: how many rank files.
      mapping: a ``hybrid.core.ParamMapping`` between a flax tree and torch's names: an orbax
        source becomes torch-named (``to="hybrid"``, ``"dcp"``); a torch-named source fills
        ``like`` (``to="orbax"``).
      like: ``to="orbax"``: ``(params, opt_state)``, the structure the resuming run restores
        into (default: the checkpoint's names nested, see ``hybrid.checkpoint.orbax``).
      param_groups: ``to="dcp"``: torch's group dicts, for a source that records none.
      progress: called with a line of text at each stage (the command line prints them).
      options: for the source's reader (DCP's ``model_key``, orbax's ``params_key``, ``item``).

    >>> import numpy as np, tempfile
    >>> from hybrid.checkpoint import save_arrays, open_checkpoint
    >>> root = tempfile.mkdtemp()
    >>> _ = save_arrays(os.path.join(root, "a"), {"w": np.ones(6, np.float32)}, step=3)
    >>> convert(os.path.join(root, "a"), os.path.join(root, "b"), to="hybrid", world_size=2).num_tensors
    1
    >>> open_checkpoint(os.path.join(root, "b")).manifest.world_size
    2
    """
    if to not in registered():
        raise ValueError(f"convert: to={to!r}; hybrid writes {list(registered())}")
    say = progress or (lambda line: None)
    dst = resolve(dst)
    if os.path.lexists(dst):
        raise FileExistsError(f"convert: {dst} exists; give a new path (a conversion never replaces a checkpoint)")
    t0 = time.perf_counter()
    ckpt = open_checkpoint(src, format=format, step=step, **options)
    fmt = format_named(to)
    if mapping is not None and (ckpt.manifest.framework == "torch") == (not fmt.writes_jax_tree):
        raise ValueError(f"convert: mapping= places a JAX tree's tensors under torch's names (an orbax or JAX source "
                         f"to hybrid / dcp) or torch's into a JAX tree (to orbax); {ckpt.path} holds "
                         f"{ckpt.manifest.framework}'s names and to={to!r} needs none")
    if mapping is not None and not fmt.writes_jax_tree:
        from hybrid.checkpoint._renamed import to_torch_names
        ckpt = to_torch_names(ckpt, mapping)
    m = ckpt.manifest
    kinds = ckpt.kinds()
    nbytes = sum(s.nbytes for s in m.plan.specs) * len(kinds)
    say(f"{ckpt.format} checkpoint at step {m.step}: {len(m.plan.specs)} tensors x {kinds}, "
        f"{nbytes / 1e6:.1f} MB; reading and checking everything first")
    write = _writer(fmt, ckpt, like=like, mapping=mapping, world_size=world_size, param_groups=param_groups)
    staging = _staging(dst)
    fs.remove_tree(staging)  # what an interrupted conversion left
    say(f"read in {time.perf_counter() - t0:.1f} s; writing {to} into {staging.name}")
    try:
        write(staging)
        os.rename(staging, dst)  # DST appears whole, or not at all
    except BaseException:
        fs.remove_tree(staging)
        raise
    say(f"wrote {dst} ({to}) in {time.perf_counter() - t0:.1f} s")
    return Converted(ckpt.format, to, m.step, len(m.plan.specs), nbytes, tuple(m.metadata.get("left_out", ())))


def _writer(fmt, ckpt, *, like=None, mapping=None, **options) -> Callable[[pathlib.Path], None]:
    """Read and check everything the ``fmt`` checkpoint needs; return what writes it to a path."""
    if fmt.writes_jax_tree:
        from hybrid.checkpoint.jax._train_state import train_state
        return fmt.writer(train_state(ckpt, like=like, mapping=mapping), **options)
    return fmt.writer(ckpt, **options)


def write_dcp(checkpoint, path: str | os.PathLike, *, model_key: str | None = None, optim_key: str | None = None,
              param_groups=None) -> None:
    """Write ``checkpoint`` (a path or an opened checkpoint, under torch's names) as a torch DCP
    directory at ``path`` with torch's own ``dcp.save`` (one process: whole tensors, which
    ``dcp.load`` reshards onto any FSDP2 mesh). ``path`` must not exist; use
    ``hybrid.checkpoint.convert`` for a write that leaves nothing there unless it completes.

    Args:
      model_key, optim_key: the keys of the model's and the optimizer's state dicts (default: the
        layout ``dcp._writer.dcp_state_dict`` chooses; torch's recipe ``"model"`` / ``"optim"``
        for a checkpoint that did not come from DCP).
      param_groups: torch's group dicts (parameters by name), for a checkpoint that records none.

    >>> import os, tempfile, torch, torch.distributed.checkpoint as dcp
    >>> from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    >>> from hybrid.checkpoint import torch as ckpt
    >>> model = torch.nn.Linear(3, 2); opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
    >>> root = tempfile.mkdtemp(); _ = ckpt.save(os.path.join(root, "h"), model, opt, step=1)
    >>> write_dcp(os.path.join(root, "h"), os.path.join(root, "dcp"))
    >>> fresh = torch.nn.Linear(3, 2); fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    >>> model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    >>> state = {"model": model_sd, "optim": optim_sd}
    >>> dcp.load(state, checkpoint_id=os.path.join(root, "dcp"), no_dist=True)
    >>> _ = set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    >>> torch.equal(fresh.weight, model.weight), fresh_opt.param_groups[0]["lr"]
    (True, 0.1)
    """
    if os.path.lexists(path):
        raise FileExistsError(f"write_dcp: {path} exists; DCP writes into a directory in place")
    write = _writer(format_named("dcp"), open_checkpoint(checkpoint), model_key=model_key, optim_key=optim_key,
                    param_groups=param_groups)
    write(path)


def write_orbax(checkpoint, path: str | os.PathLike, *, like=None, mapping=None) -> None:
    """Write ``checkpoint`` (a path or an opened checkpoint) as an orbax checkpoint at ``path``,
    with orbax's own ``StandardCheckpointer``; ``path`` must not exist (``hybrid.checkpoint
    .convert`` leaves nothing there unless the write completes).

    Args:
      like: ``(params, opt_state)`` in the structure, dtypes and shardings to write (the
        resuming run's ``init``); default: the checkpoint's names nested, and the optax state
        its optimizer suggests (see ``hybrid.checkpoint.jax._train_state``).
      mapping: a ``hybrid.core.ParamMapping`` for a checkpoint in torch's names and layouts.

    >>> import os, tempfile, numpy as np, jax.numpy as jnp, optax, orbax.checkpoint as ocp
    >>> from hybrid.checkpoint import jax as ckpt
    >>> params = {"w": jnp.arange(6.0).reshape(2, 3)}
    >>> state = optax.adam(0.1).init(params)
    >>> root = tempfile.mkdtemp(); _ = ckpt.save(os.path.join(root, "h"), params, state, step=4)
    >>> write_orbax(os.path.join(root, "h"), os.path.join(root, "orbax"), like=(params, state))
    >>> with ocp.StandardCheckpointer() as checkpointer:
    ...     back = checkpointer.restore(os.path.join(root, "orbax"), {"params": params, "opt_state": state, "step": 0})
    >>> int(back["step"]), np.array_equal(back["params"]["w"], params["w"])
    (4, True)
    """
    if os.path.lexists(path):
        raise FileExistsError(f"write_orbax: {path} exists")
    _writer(format_named("orbax"), open_checkpoint(checkpoint), like=like, mapping=mapping)(path)
