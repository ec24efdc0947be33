"""``python -m hybrid.kernels build``: compile the CUDA library (or ``--host``, the emulation)."""

import sys

from hybrid.kernels._build import BUILD_DIR, build


def _main(argv: list[str]) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m hybrid.kernels")
    parser.add_argument("command", choices=("build",))
    parser.add_argument("--build-dir", default=None, help=f"default {BUILD_DIR}")
    parser.add_argument("--host", action="store_true", help="build the host emulation instead")
    args = parser.parse_args(argv)
    print(build(args.build_dir, host=args.host))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
