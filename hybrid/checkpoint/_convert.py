"""``convert(SRC, DST, to=...)``: a checkpoint of any format hybrid reads, written in another.

Everything is read and checked before anything is written (an optimizer hybrid does not know, a
tensor the mapping cannot place, a missing step: refused, naming it, with nothing at DST). The
new checkpoint is written into a hidden sibling (``.DST.converting``) and renamed to DST once
complete, so DST holds a whole checkpoint or nothing; an existing DST is never replaced.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Callable

from hybrid.checkpoint._formats import FORMATS, open_checkpoint
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
    if to not in FORMATS:
        raise ValueError(f"convert: to={to!r}; hybrid writes {list(FORMATS)}")
    say = progress or (lambda line: None)
    dst = resolve(dst)
    if os.path.lexists(dst):
        raise FileExistsError(f"convert: {dst} exists; give a new path (a conversion never replaces a checkpoint)")
    t0 = time.perf_counter()
    ckpt = open_checkpoint(src, format=format, step=step, **options)
    if mapping is not None and (ckpt.manifest.framework == "torch") == (to != "orbax"):
        raise ValueError(f"convert: mapping= places a JAX tree's tensors under torch's names (an orbax or JAX source "
                         f"to hybrid / dcp) or torch's into a JAX tree (to orbax); {ckpt.path} holds "
                         f"{ckpt.manifest.framework}'s names and to={to!r} needs none")
    if mapping is not None and to != "orbax":
        from hybrid.checkpoint._renamed import to_torch_names
        ckpt = to_torch_names(ckpt, mapping)
    m = ckpt.manifest
    kinds = ckpt.kinds()
    nbytes = sum(s.nbytes for s in m.plan.specs) * len(kinds)
    say(f"{ckpt.format} checkpoint at step {m.step}: {len(m.plan.specs)} tensors x {kinds}, "
        f"{nbytes / 1e6:.1f} MB; reading and checking everything first")
    write = _writer(ckpt, to, world_size=world_size, mapping=mapping, like=like, param_groups=param_groups)
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


def _writer(ckpt, to: str, *, world_size, mapping, like, param_groups) -> Callable[[pathlib.Path], None]:
    """Read and check everything the ``to`` checkpoint needs; return what writes it to a path."""
    m = ckpt.manifest
    if to == "dcp":
        from hybrid.checkpoint.dcp._writer import dcp_state_dict, save_here
        state = dcp_state_dict(ckpt, param_groups=param_groups)
        return lambda path: save_here(state, path)
    if to == "orbax":
        import orbax.checkpoint as ocp

        from hybrid.checkpoint.orbax._writer import orbax_tree
        tree = orbax_tree(ckpt, like=like, mapping=mapping)

        def write_orbax(path):
            with ocp.StandardCheckpointer() as checkpointer:  # closing waits for the save, ends its threads
                checkpointer.save(os.fspath(path), tree)
        return write_orbax
    from hybrid.core import plan_buckets
    from hybrid.checkpoint._write import save_arrays
    ckpt.verify()
    params = ckpt.tensors("params")
    slots = {s: ckpt.tensors(s) for s in (m.optimizer.slots if m.optimizer else ())}
    buffers = ckpt.buffers()
    metadata = {**m.metadata, "converted_from": ckpt.format}
    return lambda path: save_arrays(path, params, world_size=world_size, step=m.step, slots=slots,
                                    optimizer=m.optimizer, plan=plan_buckets(m.plan.specs), framework=m.framework, metadata=metadata,
                                    buffers=buffers, run_state=dict(m.run_state),
                                    buffer_dtypes={n: e["dtype"] for n, e in m.buffers.items()})
