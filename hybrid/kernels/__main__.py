"""``python -m hybrid.kernels build | resources``: compile the CUDA library (or ``--host``, the
emulation), or print what ptxas and cuobjdump say of the kernel for sm_80 and sm_90."""

import argparse
import dataclasses
import json
import sys

from hybrid.kernels._build import BUILD_DIR, build


def print_resources(rows) -> None:
    from hybrid.kernels._tables import launch_config
    c = launch_config()
    print(f"hb_kernel at the host code's launch configuration: {c.threads_per_block} threads per block, "
          f"up to {c.max_blocks} blocks and {c.max_segments} copies per launch")
    print(f"{'arch':<6} {'regs':>4} {'spills':>6} {'stack':>5} {'smem':>4} {'params':>6} "
          f"{'blocks/SM':>9} {'occupancy':>9} {'limiter':<8} 128-bit global ops")
    for r in rows:
        o = r.occupancy
        wide = f"LDG.128 x{r.global_ops.get('LDG.128', 0)}, STG.128 x{r.global_ops.get('STG.128', 0)}"
        print(f"{r.arch:<6} {r.registers:>4} {r.spill_store_bytes + r.spill_load_bytes:>6} {r.stack_bytes:>5} "
              f"{r.shared_bytes:>4} {r.param_bytes:>6} {o.blocks_per_sm:>9} {o.fraction:>9.0%} {o.limiter:<8} {wide}")


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid.kernels")
    parser.add_argument("command", choices=("build", "resources"))
    parser.add_argument("--build-dir", default=None, help=f"build: default {BUILD_DIR}")
    parser.add_argument("--host", action="store_true", help="build: the host emulation instead")
    parser.add_argument("--json", action="store_true", help="resources: print JSON")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build(args.build_dir, host=args.host))
        return 0
    from hybrid.kernels._resources import ARCHS, kernel_resources
    try:
        rows = [kernel_resources(arch) for arch in ARCHS]
    except RuntimeError as e:
        parser.exit(2, f"{parser.prog}: {e}\n")
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print_resources(rows)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
