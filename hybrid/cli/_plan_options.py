"""What ``python -m hybrid plan`` plans at and views with, as plain values (the command builds them)."""

from __future__ import annotations

import dataclasses

from hybrid.core import MiB, ddp_size_limits


@dataclasses.dataclass(frozen=True, slots=True)
class Caps:
    """Bucket caps as torch's DDP takes ``bucket_cap_mb``: left out (``None``), 25 MiB with a 1 MiB
    first bucket; given, the first bucket gets it too (torch's ``_BucketCapacityConfig.create``),
    unless ``first_bucket_cap_mb`` sets it apart.

    >>> Caps().size_caps, Caps(bucket_cap_mb=2.0).size_caps, Caps(2.0, first_bucket_cap_mb=0.5).size_caps
    ((26214400, 1048576), (2097152, 2097152), (2097152, 524288))
    """

    bucket_cap_mb: float | None = None
    first_bucket_cap_mb: float | None = None

    def __post_init__(self):
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")

    @property
    def _torch_caps(self) -> tuple[int, int]:
        """``(cap, first cap)`` of torch's DDP built with this ``bucket_cap_mb``, as hybrid.core
        says torch rebuilds its buckets (``ddp_size_limits``; equal caps are spelled once there)."""
        given = None if self.bucket_cap_mb is None else int(self.bucket_cap_mb * MiB)
        limits = ddp_size_limits(bucket_cap_bytes=given)[1]
        return limits[-1], limits[0]

    @property
    def bucket_cap_bytes(self) -> int:
        return self._torch_caps[0]

    @property
    def first_bucket_cap_bytes(self) -> int:
        return self._torch_caps[1] if self.first_bucket_cap_mb is None else int(self.first_bucket_cap_mb * MiB)

    @property
    def size_caps(self) -> tuple[int, int]:
        return self.bucket_cap_bytes, self.first_bucket_cap_bytes

    @property
    def as_torch_builds_them(self) -> bool:
        """Whether torch's DDP can be built at these caps (it takes no first-bucket cap of its own)."""
        return self.first_bucket_cap_bytes == self._torch_caps[1]


@dataclasses.dataclass(frozen=True, slots=True)
class ZeroView:
    """What the ZeRO view is of: ranks, the optimizer's state per parameter, ZeRO-3's prefetch."""

    world_size: int = 4
    optimizer: str = "adam"
    prefetch: int = 1
    master_weights: bool = False

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {self.world_size}")
        if self.prefetch < 0:
            raise ValueError(f"--prefetch must be >= 0, got {self.prefetch}")
