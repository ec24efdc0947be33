"""What can be known of the kernels without a GPU (issue 25): registers, spills and shared memory
from ptxas, 128-bit global loads and stores in the SASS, theoretical occupancy at the host code's
launch configuration, and the launch counts the H100 projection rests on."""

import ctypes
import json

import pytest

from hybrid.bench.pack import _projection as _pack_projection
from hybrid.core import TensorSpec, plan_buckets
from hybrid.kernels._projection import H100_SXM, project_plan
from hybrid.kernels._resources import ARCHS, copy_path_ops, cuda_tool, kernel_resources, occupancy
from hybrid.kernels._tables import launch_config

needs_toolchain = pytest.mark.skipif(
    cuda_tool("nvcc") is None or cuda_tool("cuobjdump") is None,
    reason="needs nvcc (CUDA toolkit) and cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")

# (arch, registers, threads per block, shared bytes) -> (blocks per SM, occupancy, limiter), worked
# by hand from the programming guide's per-SM limits (65536 registers given per warp in units of
# 256, 2048 threads, 32 blocks, 164 / 228 KiB shared with 1 KiB reserved per block), as NVIDIA's
# occupancy calculator does.
OCCUPANCY = [
    ("sm_80", 32, 512, 0, 4, 1.0, "threads"),
    ("sm_90", 33, 512, 0, 3, 0.75, "registers"),  # 33 registers round up to 40 per thread
    ("sm_80", 64, 256, 0, 4, 0.5, "registers"),
    ("sm_90", 255, 128, 0, 2, 0.125, "registers"),
    ("sm_80", 16, 32, 0, 32, 0.5, "blocks"),
    ("sm_80", 32, 256, 48 << 10, 3, 0.375, "shared memory"),
    ("sm_90", 32, 256, 48 << 10, 4, 0.5, "shared memory"),
]


@pytest.mark.parametrize("arch,regs,threads,smem,blocks,fraction,limiter", OCCUPANCY)
def test_occupancy_calculator(arch, regs, threads, smem, blocks, fraction, limiter):
    o = occupancy(arch, registers=regs, threads_per_block=threads, shared_bytes=smem)
    assert (o.blocks_per_sm, o.fraction, o.limiter) == (blocks, fraction, limiter)


@pytest.fixture(scope="module", params=ARCHS)
def resources(request, tmp_path_factory):
    return kernel_resources(request.param, workdir=tmp_path_factory.mktemp("cubin"))


@needs_toolchain
def test_no_spills_no_stack_no_shared_memory(resources):
    assert (resources.spill_store_bytes, resources.spill_load_bytes, resources.stack_bytes) == (0, 0, 0)
    assert resources.shared_bytes == 0  # the launch table lives in the parameter bank, not in shared memory


@needs_toolchain
def test_launch_table_is_the_kernel_parameter(resources, host_lib):
    host_lib.hybrid_table_bytes.restype = ctypes.c_int
    assert resources.param_bytes == host_lib.hybrid_table_bytes()  # sizeof(hb_table), passed by value
    assert resources.param_bytes <= 32764  # the kernel parameter limit on sm_70+ (CUDA 12.1 and later)


@needs_toolchain
def test_full_occupancy_at_the_host_launch_configuration(resources):
    # 512 threads per block: 4 blocks and 64 warps per SM when the kernel keeps to 32 registers
    assert resources.registers <= 32
    assert resources.occupancy.fraction == 1.0
    assert resources.occupancy.blocks_per_sm * launch_config().threads_per_block == 2048


@needs_toolchain
def test_kernel_has_128_bit_global_loads_and_stores(resources):
    assert resources.global_ops.get("LDG.128", 0) > 0 and resources.global_ops.get("STG.128", 0) > 0


@needs_toolchain
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("width,ops", [(16, {"LDG.128", "STG.128"}), (8, {"LDG.64", "STG.64"})])
def test_aligned_copy_loop_moves_whole_vectors(arch, width, ops, tmp_path):
    # the loop an aligned bucket takes compiles to one wide load and store per vector, nothing narrower
    assert set(copy_path_ops(arch, width, workdir=tmp_path)) == ops


def test_projection_counts_launches_and_bytes():
    specs = [TensorSpec(f"w{i}", (1024, 1024), "float32") for i in range(8)]
    copies = project_plan(plan_buckets(specs))
    member_bytes = 8 * (1 << 22)
    assert sum(c.bytes_moved for c in copies) == 4 * member_bytes  # gather and scatter each read and write
    expected = sum(c.launches for c in copies) * H100_SXM.launch_s + 4 * member_bytes / (
        H100_SXM.hbm_bytes_per_s * H100_SXM.copy_efficiency)
    assert sum(c.seconds for c in copies) == pytest.approx(expected, rel=1e-12)


def test_bench_pack_project_json(capsys):
    assert _pack_projection.main({}, tokens=8192, mfu=0.4, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert row["workload"] == "gpt2-small" and row["tensors"] == 148
    # 124M float32 gradients, gathered and scattered: 4 x 498 MB read or written
    assert row["bytes_moved"] == pytest.approx(4 * 124_439_808 * 4, rel=1e-3)
    assert 0 < row["fraction_of_gpt2_step"] < 0.2
    assert row["seconds"] / report["gpt2_step"]["seconds"] == pytest.approx(row["fraction_of_gpt2_step"])
