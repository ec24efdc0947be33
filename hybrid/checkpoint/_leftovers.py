"""What interrupted saves leave beside checkpoints, found and cleared.

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

from hybrid.checkpoint._manifest import MANIFEST
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
