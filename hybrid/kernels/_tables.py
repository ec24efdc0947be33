"""How many launches and blocks a batched copy takes, as the host table builder decides it.

The constants are read from ``kernels/batched_copy.cuh`` and ``batched_copy.cu`` (one source of
truth), and :func:`count_launches` walks the copy list the way ``hb_next_table`` does, without
building the tables. The kernel tests hold it equal to the launches the compiled host emulation
reports, so the projection (``python -m hybrid bench pack --project``) counts what the GPU will run.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

from hybrid.kernels._build import KERNELS_DIR


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchConfig:
    """The launch configuration the host code chooses (``#define``s of the CUDA source)."""

    threads_per_block: int  # HB_THREADS
    max_segments: int  # HB_MAX_SEGS: copies per launch table
    max_blocks: int  # HB_MAX_BLOCKS: blocks per launch
    min_chunk_bytes: int  # HB_MIN_CHUNK_BYTES: the smallest piece one block copies
    target_blocks: int  # HB_TARGET_BLOCKS: a call's bytes are cut in about this many chunks


@functools.cache
def launch_config() -> LaunchConfig:
    """The constants of ``kernels/`` as the compiled code has them.

    >>> launch_config().threads_per_block
    512
    """
    text = (KERNELS_DIR / "batched_copy.cuh").read_text() + (KERNELS_DIR / "batched_copy.cu").read_text()

    def define(name: str) -> int:
        match = re.search(rf"^#define {name} (\d+)\s*$", text, re.MULTILINE)
        if match is None:
            raise RuntimeError(f"#define {name} not found in {KERNELS_DIR}: the CUDA sources changed shape")
        return int(match.group(1))

    return LaunchConfig(define("HB_THREADS"), define("HB_MAX_SEGS"), define("HB_MAX_BLOCKS"),
                        define("HB_MIN_CHUNK_BYTES"), define("HB_TARGET_BLOCKS"))


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchCount:
    launches: int
    blocks: int  # over all launches


def chunk_bytes(total_bytes: int, config: LaunchConfig | None = None) -> int:
    """Bytes one block copies: ``max(32 KiB, total / 1024)`` rounded up to 16 (``hb_builder_init``).

    >>> chunk_bytes(100), chunk_bytes(64 << 20)
    (32768, 65536)
    """
    c = config or launch_config()
    chunk = (total_bytes // c.target_blocks + 15) // 16 * 16
    return max(chunk, c.min_chunk_bytes)


def count_launches(segment_bytes: Sequence[int], *, convert_itemsize: int | None = None,
                   zero_fills: Sequence[bool] | None = None, config: LaunchConfig | None = None) -> LaunchCount:
    """Launches and blocks of one batched copy whose copies (zero fills included) have these sizes.

    Args:
      segment_bytes: each copy's size in destination bytes, in call order.
      convert_itemsize: for a cast or scale, the destination itemsize (the chunk is then counted
        in elements, as ``hb_make_seg`` does); None for a plain copy.
      zero_fills: which copies write zeros (gaps and padding of a gather): they are cut in bytes
        even in a cast.

    >>> count_launches([4096] * 200).launches  # 128 copies fit one table
    2
    >>> count_launches([64 << 20])  # one 64 MiB tensor: 1024 chunks of 64 KiB
    LaunchCount(launches=1, blocks=1024)
    """
    c = config or launch_config()
    chunk = chunk_bytes(sum(segment_bytes), c)
    launches = blocks = 0
    segs = table_blocks = 0
    zero_fills = zero_fills or [False] * len(segment_bytes)
    for n, zero in zip(segment_bytes, zero_fills, strict=True):
        if n == 0:
            continue  # empty copies take no segment
        if convert_itemsize and not zero:
            per_block = chunk // convert_itemsize
            chunks = -(-(n // convert_itemsize) // per_block)
        else:
            chunks = -(-n // chunk)
        while chunks:
            if segs == c.max_segments or table_blocks == c.max_blocks:
                launches, blocks, segs, table_blocks = launches + 1, blocks + table_blocks, 0, 0
            take = min(chunks, c.max_blocks - table_blocks)
            segs, table_blocks, chunks = segs + 1, table_blocks + take, chunks - take
    if table_blocks:
        launches, blocks = launches + 1, blocks + table_blocks
    return LaunchCount(launches, blocks)
