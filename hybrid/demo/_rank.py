"""One rank of :func:`hybrid.demo.spawn_world`'s gloo world: ``python -m hybrid.demo._rank``, or a fork
of ``hybrid.demo._rank_server`` running :func:`run`.

Reads ``(header, job)`` from stdin (pickled by the parent), connects back to the parent, joins the
gloo group and runs the job, sending progress, rank 0's result or its traceback. Anything that
goes wrong before the connection exists lands on stderr, which the parent keeps and shows.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import traceback
from multiprocessing.connection import Client


def main() -> int:
    return run(sys.stdin.buffer.read())


def run(rank_input: bytes) -> int:
    """Be the rank ``rank_input`` (the pickled ``(header, job)``) describes; its exit code.

    Called by :func:`main` in a fresh interpreter, and by ``hybrid.demo._rank_server`` in a fork.
    """
    header, job = pickle.loads(rank_input)
    sys.path[:] = header["sys_path"]  # as the parent finds modules (its script's folder, the working directory)
    rank = header["rank"]
    with Client(header["address"], authkey=header["authkey"]) as parent:
        try:
            import torch.distributed as dist

            from hybrid.demo._torch_run import pin_torch_numerics

            fn, args, kwargs = pickle.loads(job)  # imports the job's modules: their errors are reported too
            pin_torch_numerics()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{header['port']}", rank=rank,
                                    world_size=header["world_size"],
                                    timeout=datetime.timedelta(seconds=header["collective_timeout_s"]))
            progress = (lambda *a: parent.send(("progress", a))) if header["report_progress"] else None
            value = fn(*args, **kwargs, progress=progress)
            if rank == 0:
                parent.send(("result", value))
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            parent.send(("error", rank, traceback.format_exc()))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
