"""Train the twin MLP with hybrid.jax.zero over every device of every process (jax.distributed).

    python examples/jax_train.py --coordinator 127.0.0.1:29500 --num-processes 2 --process-id 0 --steps 20
    python examples/jax_train.py --coordinator 127.0.0.1:29500 --num-processes 2 --process-id 1 --steps 20

Each process runs this once (on one machine or many); the arguments default to the environment
variables COORDINATOR_ADDRESS, NUM_PROCESSES and PROCESS_ID. The mesh spans all processes'
devices (``--cpu-devices`` host devices each on CPU); device r trains on rows [r*B/W, (r+1)*B/W)
of every global batch, and process 0 prints each step's global loss. ``--save PATH --save-at K``
saves a checkpoint after step K (every process writes the files of its devices; PATH on a file
system all share), ``--resume PATH`` continues from one, at any number of processes;
``--checkpoint-dir DIR --save-every N`` saves every N steps and a relaunch resumes from the newest.
"""

import os


def _cluster(p) -> None:
    p.add_argument("--coordinator", default=os.environ.get("COORDINATOR_ADDRESS", "127.0.0.1:29500"))
    p.add_argument("--num-processes", type=int, default=int(os.environ.get("NUM_PROCESSES", "1")))
    p.add_argument("--process-id", type=int, default=int(os.environ.get("PROCESS_ID", "0")))
    p.add_argument("--cpu-devices", type=int, default=1, help="host CPU devices per process")


def main() -> None:
    from _common import checkpoint_args, parse, progress_of, report

    config, args = parse(__doc__.splitlines()[0], _cluster)
    # Before jax starts: the number of host devices per process.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.cpu_devices}")
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from hybrid.demo import train_jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120)
    mesh = Mesh(np.array(jax.devices()), ("dp",))  # global device order: process 0's devices first
    first = jax.process_index() == 0
    result = train_jax(config, mesh=mesh, progress=progress_of(args) if first else None,
                       **checkpoint_args(args, say=first))
    if first:
        report(result, args, mesh.size)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
