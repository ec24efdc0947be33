"""A folder of checkpoints: the newest complete one, and what interrupted saves left beside them.

:func:`latest` is what a relaunched job resumes from (torchrun's ``--max-restarts`` does not
restart a gloo job, so recovery is relaunching the same command: docs/torch-api.md, "Recovering from
a crash").

A save of ``NAME`` works in two hidden siblings (``hybrid.checkpoint._protocol``): ``.NAME.saving``
and ``.NAME.previous``. A failed save removes its ``.saving`` where a process lives to do it; a
killed one cannot, and with a new ``NAME`` per step (``step-01000``, ``step-02000`` ...) no later
save of the same name comes to clear it. :func:`leftovers` lists them in a folder,
:func:`clear_leftovers` removes them, and neither ever removes the only complete copy of a
checkpoint: a ``.NAME.previous`` whose ``NAME`` is missing (a save killed between the two renames
of its swap) is put back to ``NAME``, as the next save of ``NAME`` would.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import warnings

from hybrid.checkpoint._files import Checkpoint
from hybrid.checkpoint._manifest import MANIFEST, CheckpointError
from hybrid.checkpoint._protocol import fs

_HIDDEN = re.compile(r"\.(?P<name>.+)\.(?P<kind>saving|previous)")


@dataclasses.dataclass(frozen=True, slots=True)
class Leftover:
    """A hidden sibling an interrupted save left: where it is, which checkpoint it belongs to,
    and what :func:`clear_leftovers` does with it: ``"remove"``, ``"restore"`` (to ``checkpoint``,
    which is missing), or ``"keep"`` (the only complete copy, beside a ``checkpoint`` that is not
    one: left for you to look at)."""

    path: pathlib.Path
    checkpoint: pathlib.Path
    kind: str  # "saving" (never committed) or "previous" (a replaced checkpoint)
    action: str  # "remove", "restore" or "keep"

    def __str__(self) -> str:
        name = self.checkpoint.name
        what = {"saving": f"an unfinished save of {name}, never committed",
                "previous": f"the copy of {name} a save replaced"}[self.kind]
        do = {"remove": "remove",
              "restore": f"restore: {name} is missing and this is its only complete copy",
              "keep": f"keep: the only complete copy; {name} holds no manifest"}[self.action]
        return f"{self.path}: {what} ({do})"


def leftovers(folder: str | os.PathLike) -> list[Leftover]:
    """The ``.NAME.saving`` and ``.NAME.previous`` directories in ``folder``, sorted by path.

    Do not run it (or :func:`clear_leftovers`) while a save into ``folder`` is running: its
    staging directory would be listed as a leftover.

    >>> import tempfile, numpy as np
    >>> from hybrid.checkpoint import save_arrays
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = save_arrays(folder / "step-1", {"w": np.ones(2, np.float32)})
    >>> (folder / ".step-2.saving").mkdir()  # a save of step-2 killed before its commit
    >>> [(x.path.name, x.checkpoint.name, x.action) for x in leftovers(folder)]
    [('.step-2.saving', 'step-2', 'remove')]
    >>> [x.name for x in clear_leftovers(folder)], sorted(p.name for p in folder.iterdir())
    (['.step-2.saving'], ['step-1'])
    """
    folder = pathlib.Path(folder)
    found = []
    for entry in sorted(folder.iterdir()):
        m = _HIDDEN.fullmatch(entry.name)
        if m is None or not entry.is_dir() or entry.is_symlink():
            continue
        checkpoint = folder / m["name"]
        action = "remove"
        if m["kind"] == "previous" and (entry / MANIFEST).exists() and not (checkpoint / MANIFEST).exists():
            action = "keep" if checkpoint.exists() else "restore"
        found.append(Leftover(entry, checkpoint, m["kind"], action))
    return found


def clear_leftovers(folder: str | os.PathLike) -> list[pathlib.Path]:
    """Clear what :func:`leftovers` lists: remove each unfinished save and each replaced
    checkpoint whose successor is in place, put back each replaced checkpoint whose successor
    is missing (a ``"keep"`` is left alone). Returns the paths removed or restored. See
    :func:`leftovers` for when not to."""
    done = []
    for leftover in leftovers(folder):
        if leftover.action == "restore":
            fs.replace(leftover.path, leftover.checkpoint)
        elif leftover.action == "remove":
            fs.remove_tree(leftover.path)
        else:
            continue
        done.append(leftover.path)
    return done


def latest(folder: str | os.PathLike) -> pathlib.Path | None:
    """The checkpoint in ``folder`` with the highest saved step (its manifest's), or None if it
    holds none: what a relaunched job resumes from.

    Only committed checkpoints count (a save in progress or killed before its commit is hidden,
    ``.NAME.saving``); one whose swap a crash cut in two is found through its ``.NAME.previous``,
    as any reader finds it. A directory whose manifest cannot be read is skipped with a warning
    naming it. Ties go to the later name.

    >>> import tempfile, numpy as np
    >>> from hybrid.checkpoint import save_arrays
    >>> runs = pathlib.Path(tempfile.mkdtemp())
    >>> latest(runs) is None
    True
    >>> for step in (200, 400):
    ...     _ = save_arrays(runs / f"step-{step:06d}", {"w": np.ones(2, np.float32)}, step=step)
    >>> (runs / ".step-000600.saving").mkdir()  # killed before its commit: not a checkpoint
    >>> latest(runs).name
    'step-000400'
    """
    folder = pathlib.Path(folder)
    names = {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
    names |= {x.checkpoint.name for x in leftovers(folder) if x.action == "restore"}
    found = []
    for name in sorted(names):
        if not ((folder / name / MANIFEST).exists() or (folder / f".{name}.previous" / MANIFEST).exists()):
            continue  # not a checkpoint (a folder of something else)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "reading the previous checkpoint": expected here
                step = Checkpoint(folder / name).manifest.step
        except CheckpointError as e:
            warnings.warn(f"latest: skipping {folder / name}: {e}", stacklevel=2)
            continue
        found.append((step, name))
    return folder / max(found)[1] if found else None
