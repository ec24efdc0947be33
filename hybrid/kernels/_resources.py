"""What can be known of the kernels without a GPU: registers, spills, shared memory and parameter
bytes (``ptxas -v``, ``cuobjdump -res-usage``), the width of the global loads and stores in the
SASS (``cuobjdump -sass``), and the theoretical occupancy at the launch configuration the host
code chooses.

``python -m hybrid.kernels resources`` prints the table docs/kernels.md shows. nvcc comes with the
CUDA toolkit; cuobjdump and nvdisasm, where the toolkit lacks them, from PyPI
(``nvidia-cuda-cuobjdump``, ``nvidia-cuda-nvdisasm``, in the ``kernels`` extra).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from hybrid.kernels._build import KERNELS_DIR, NVCC_FLAGS
from hybrid.kernels._tables import launch_config

ARCHS = ("sm_80", "sm_90")


@dataclasses.dataclass(frozen=True, slots=True)
class SMLimits:
    """Per-SM limits of a compute capability (CUDA programming guide, "Compute Capabilities")."""

    registers: int = 65536
    reg_alloc_unit: int = 256  # registers are given to a warp in units of this many
    max_threads: int = 2048
    max_blocks: int = 32
    shared_bytes: int = 167936  # configurable L1/shared carve-out, the maximum
    shared_reserved_per_block: int = 1024  # the system's per-block reservation


SM_LIMITS = {"sm_80": SMLimits(shared_bytes=164 << 10), "sm_90": SMLimits(shared_bytes=228 << 10)}


@dataclasses.dataclass(frozen=True, slots=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    fraction: float  # active warps / the SM's maximum
    limiter: str  # "threads", "registers", "shared memory" or "blocks"


def occupancy(arch: str, *, registers: int, threads_per_block: int, shared_bytes: int = 0) -> Occupancy:
    """Theoretical occupancy, as CUDA's occupancy calculator computes it.

    >>> occupancy("sm_90", registers=32, threads_per_block=512)
    Occupancy(blocks_per_sm=4, warps_per_sm=64, fraction=1.0, limiter='threads')
    >>> occupancy("sm_80", registers=128, threads_per_block=256).fraction
    0.25
    """
    lim = SM_LIMITS[arch]
    warps = -(-threads_per_block // 32)
    regs_per_warp = -(-registers * 32 // lim.reg_alloc_unit) * lim.reg_alloc_unit
    by = {
        "threads": lim.max_threads // (warps * 32),
        "registers": (lim.registers // regs_per_warp) // warps if registers else lim.max_blocks,
        "shared memory": lim.shared_bytes // (shared_bytes + lim.shared_reserved_per_block),
        "blocks": lim.max_blocks,
    }
    limiter = min(by, key=by.get)
    blocks = by[limiter]
    return Occupancy(blocks, blocks * warps, blocks * warps / (lim.max_threads // 32), limiter)


@dataclasses.dataclass(frozen=True, slots=True)
class KernelResources:
    arch: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int
    param_bytes: int  # the launch table passed by value (CONSTANT[0] holds it and the driver's part)
    global_ops: dict  # SASS global memory ops by width, e.g. {"LDG.128": 5, "STG.128": 10}
    occupancy: Occupancy


def cuda_tool(name: str) -> str | None:
    """A CUDA binary from PATH, else from the ``nvidia-cuda-*`` wheels (``nvidia/cu*/bin``)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for root in nvidia.__path__:
        for candidate in sorted(Path(root).glob(f"cu*/bin/{name}"), reverse=True):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return None


_PTXAS = {
    "registers": r"Used (\d+) registers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
}
# ``LDG.E.128``, ``STG.E.U16``, ``LDG.E.64.CONSTANT``: the width is the number (32 bits when none)
_GLOBAL_OP = re.compile(r"\b(LDG|STG)((?:\.[A-Z0-9_]+)*)")


def _width(modifiers: str) -> str:
    for m in modifiers.split("."):
        if m in ("128", "64", "U16", "S16", "U8", "S8"):
            return {"U16": "16", "S16": "16", "U8": "8", "S8": "8"}.get(m, m)
    return "32"


def global_ops(sass: str) -> dict[str, int]:
    """Counts of global loads and stores by width in bits in a SASS listing.

    >>> global_ops("LDG.E.128 R4, desc[UR4][R2.64] ;\\nSTG.E.U8 desc[UR4][R6.64], R9 ;")
    {'LDG.128': 1, 'STG.8': 1}
    """
    counts = collections.Counter(f"{op}.{_width(mods)}" for op, mods in _GLOBAL_OP.findall(sass))
    return dict(sorted(counts.items()))


class _Toolchain:
    """nvcc and cuobjdump, found once; RuntimeError naming the one that is missing."""

    def __init__(self):
        self.nvcc, self.cuobjdump = cuda_tool("nvcc"), cuda_tool("cuobjdump")
        if self.nvcc is None or self.cuobjdump is None:
            missing = "nvcc (the CUDA toolkit)" if self.nvcc is None else "cuobjdump (pip install nvidia-cuda-cuobjdump)"
            raise RuntimeError(f"cannot inspect the kernels: {missing} not found")
        # cuobjdump -sass runs nvdisasm, which the wheels put beside it
        self.env = dict(os.environ, PATH=os.pathsep.join([str(Path(self.cuobjdump).parent), os.environ.get("PATH", "")]))

    def cubin(self, source: Path, out: Path, arch: str, *extra: str) -> str:
        """Compile ``source`` for ``arch``; returns what nvcc printed (ptxas's report with ``-Xptxas -v``)."""
        done = subprocess.run([self.nvcc, *NVCC_FLAGS, "-cubin", f"-arch={arch}", *extra, str(source), "-o", str(out)],
                              capture_output=True, text=True, check=True)
        return done.stderr

    def dump(self, cubin: Path, what: str) -> str:
        return subprocess.run([self.cuobjdump, what, str(cubin)], capture_output=True, text=True, check=True,
                              env=self.env).stdout


def kernel_resources(arch: str, *, workdir: str | os.PathLike | None = None) -> KernelResources:
    """Compile ``hb_kernel`` for ``arch`` and read its resources off ptxas and cuobjdump.

    Raises RuntimeError naming the missing tool where nvcc or cuobjdump is not installed.
    """
    tools = _Toolchain()
    import jax.ffi  # the XLA FFI headers batched_copy.cu includes
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        cubin = Path(tmp) / f"hb_{arch}.cubin"
        printed = tools.cubin(KERNELS_DIR / "batched_copy.cu", cubin, arch, "-Xptxas", "-v",
                              "-I", jax.ffi.include_dir())
        sass, usage, elf = (tools.dump(cubin, what) for what in ("-sass", "-res-usage", "-elf"))
    report = printed[printed.index("Compiling entry function '_Z9hb_kernel"):]
    found = {k: int(re.search(p, report).group(1)) for k, p in _PTXAS.items()}
    shared = int(re.search(r"SHARED:(\d+)", usage).group(1))
    # the kernel's parameter block (the launch table); bank 0 also holds the driver's own constants
    param = int(re.search(r"EIATTR_CBANK_PARAM_SIZE\s+Format:\s+\S+\s+Value:\s+(0x[0-9a-f]+)", elf).group(1), 16)
    return KernelResources(
        arch=arch, shared_bytes=shared, param_bytes=param, global_ops=global_ops(sass),
        occupancy=occupancy(arch, registers=found["registers"], threads_per_block=launch_config().threads_per_block,
                            shared_bytes=shared),
        **found)


def copy_path_ops(arch: str, width: int, *, workdir: str | os.PathLike | None = None) -> dict[str, int]:
    """Global loads and stores of the ``width``-byte copy loop alone (``hb_copy_vec<width>``).

    The 16-byte loop is the path every bucket whose member addresses are 16-byte aligned takes
    (``hb_vec_width``, tested on the host); this shows what the compiler makes of it.
    """
    tools = _Toolchain()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        probe, cubin = Path(tmp) / "probe.cu", Path(tmp) / "probe.cubin"
        probe.write_text('#include "batched_copy.cuh"\n'
                         "__global__ void probe(const char* s, char* d, int64_t n) {\n"
                         f"  hb_copy_vec<{width}>(s, d, 0, n, threadIdx.x, blockDim.x);\n}}\n")
        tools.cubin(probe, cubin, arch, "-I", str(KERNELS_DIR))
        sass = tools.dump(cubin, "-sass")
    return global_ops(sass)
