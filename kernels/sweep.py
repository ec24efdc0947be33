"""Sweep the batched-copy kernel's launch constants on a GPU: ``python kernels/sweep.py``.

Each variant is the library built with ``-D`` overrides of the ``#ifndef`` constants of
batched_copy.cuh / .cu (sm_90 only, in parallel), checked bit for bit against the reference path,
then timed by CUDA-graph replay (the device's time alone): one pack and one unpack of every bucket
of bench pack's two workloads, plain and with a fused scale (DDP's ``1 / world_size``), beside a
device memcpy of the transformer's bytes. Run by the session that chose 32 KiB chunks and two
vectors in flight (docs/kernels.md); needs a GPU, torch with CUDA, jax (for the FFI headers).
"""

import os
import statistics
import subprocess
import tempfile

import jax.ffi
import torch

from hybrid import kernels
from hybrid.bench.pack import small_shapes, transformer_shapes
from hybrid.core import TensorSpec, plan_buckets
from hybrid.kernels import _build

VARIANTS = [
    {"HB_UNROLL": 1, "HB_MIN_CHUNK_BYTES": 16384},  # the first build
    {"HB_UNROLL": 2, "HB_MIN_CHUNK_BYTES": 16384}, {"HB_UNROLL": 4, "HB_MIN_CHUNK_BYTES": 16384},
    {"HB_UNROLL": 4, "HB_MIN_CHUNK_BYTES": 65536, "HB_TARGET_BLOCKS": 512},
    {"HB_UNROLL": 4, "HB_MIN_CHUNK_BYTES": 32768},
    {"HB_UNROLL": 2, "HB_MIN_CHUNK_BYTES": 32768},  # the default since
    {"HB_THREADS": 256, "HB_UNROLL": 4, "HB_MIN_CHUNK_BYTES": 32768},
    {"HB_UNROLL": 1, "HB_MIN_CHUNK_BYTES": 65536, "HB_TARGET_BLOCKS": 512},
    {"HB_UNROLL": 8, "HB_MIN_CHUNK_BYTES": 65536, "HB_TARGET_BLOCKS": 512},
]


def build_all(root: str) -> list[str]:
    procs, libs = [], []
    for i, v in enumerate(VARIANTS):
        lib = os.path.join(root, f"v{i}.so")
        cmd = ["nvcc", *_build.NVCC_FLAGS, "-shared", "-Xcompiler", "-fPIC,-Wno-return-type",
               "-gencode", "arch=compute_90,code=sm_90", "-I", jax.ffi.include_dir(), "-Xptxas", "-v",
               *[f"-D{k}={val}" for k, val in v.items()], str(_build.KERNELS_DIR / "batched_copy.cu"), "-o", lib]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        libs.append(lib)
    for v, p in zip(VARIANTS, procs):
        regs = [line.split(":", 1)[1].strip() for line in p.communicate()[0].splitlines() if "registers" in line]
        if p.returncode:
            raise RuntimeError(f"build of {v} failed")
        print(v, regs[:1])
    return libs


def replay_ms(fn, reps: int = 30) -> float:
    """Median device time of ``fn``'s launches, captured once in a CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    workloads = {}
    for name, shapes in (("transformer", transformer_shapes()), ("2000 small", small_shapes())):
        plan = plan_buckets([TensorSpec(f"p{i}", s, "float32") for i, s in enumerate(shapes)])
        workloads[name] = (plan, [torch.randn(s, device="cuda") for s in shapes],
                           [torch.empty(b.length, device="cuda") for b in plan.buckets])
    total = sum(g.numel() for g in workloads["transformer"][1])
    src, dst = torch.randn(total, device="cuda"), torch.empty(total, device="cuda")
    print(f"device memcpy of the transformer's {total * 4 / 1e6:.1f} MB: {replay_ms(lambda: dst.copy_(src)):.3f} ms")
    with tempfile.TemporaryDirectory() as root:
        for v, lib in zip(VARIANTS, build_all(root)):
            os.environ["HYBRID_KERNELS_LIB"] = lib
            _build._library.cache_clear()
            print(v)
            for name, (plan, grads, flats) in workloads.items():
                for what, scale in (("copy", None), ("scale", 0.5)):
                    def pack():
                        for b, f in enumerate(flats):
                            kernels.gather(plan, b, grads, f, scale=scale, backend="cuda")

                    def unpack():
                        for b, f in enumerate(flats):
                            kernels.scatter(plan, b, f, grads, scale=scale, backend="cuda")

                    pack()
                    for b, f in enumerate(flats):
                        want = kernels.gather(plan, b, grads, scale=scale, backend="reference")
                        assert torch.equal(f[:want.numel()], want), (v, name, b)
                    print(f"  {name:<12} {what:<5} pack {replay_ms(pack):.3f} ms, unpack {replay_ms(unpack):.3f} ms")


if __name__ == "__main__":
    main()
