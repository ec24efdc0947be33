"""Free the process groups that a reference cycle keeps alive before the interpreter finalizes.

A DDP and an optimizer that hooks into it (``ZeRO2``, the overlap hooks) refer to each other, as
torch's ``ddp_zero_hook`` does: after ``destroy_process_group`` the pair, and with it the process
group, lives until a garbage collection. If that is the one inside interpreter finalization, a
gloo worker thread that drops the last reference to a finished collective needs the GIL to free
its tensors' Python objects, cannot take it any more, and the whole process aborts ("terminate
called without an active exception", exit code -6, torchrun reports the rank failed) after a run
that succeeded. An ``atexit`` handler runs before finalization starts: collecting there frees the
pair and the group's destructor joins its workers while Python still runs.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def collect_cycles_at_exit() -> None:
    """Make sure a garbage collection runs at exit while Python can still run every destructor
    (once per process, however often called).

    >>> collect_cycles_at_exit(); collect_cycles_at_exit()  # registers one handler
    """
    global _registered
    if not _registered:
        atexit.register(gc.collect)
        _registered = True
