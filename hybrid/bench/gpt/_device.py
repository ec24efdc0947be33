"""Where a GPT bench runs: the check that the asked device is there (a clear refusal when it is
not, before any process starts), and, for a torch rank, how to wait for its device and read its
allocator's counts."""

from __future__ import annotations

import os


def torch_ranks(device: str, ranks: int | None) -> int:
    """How many torch ranks the bench starts on ``device``; a ValueError saying what is missing.

    ``cuda``: one NCCL rank per GPU (NCCL refuses two ranks on one device), every visible GPU
    unless ``ranks`` asks for fewer. ``cpu``: ``ranks`` gloo ranks, one by default.

    >>> torch_ranks("cpu", None), torch_ranks("cpu", 3)
    (1, 3)
    """
    import torch
    import torch.distributed as dist

    if device == "cpu":
        return 1 if ranks is None else ranks
    if not torch.cuda.is_available():
        why = (f"this torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else
               f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU; "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}")
        raise ValueError(f"--device cuda: no CUDA GPU is visible: torch.cuda.is_available() is False ({why})")
    if not dist.is_nccl_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} is built without NCCL, which the ranks need")
    visible = torch.cuda.device_count()
    if ranks is not None and ranks > visible:
        raise ValueError(f"--ranks {ranks}: NCCL needs a GPU per rank, and {visible} "
                         f"GPU{'s are' if visible != 1 else ' is'} visible")
    return visible if ranks is None else ranks


def jax_devices(device: str, ranks: int | None) -> list:
    """The JAX devices the bench's mesh spans; a ValueError saying what is missing.

    ``cuda``: JAX's GPU devices (the ``gpu`` backend, jax[cuda12]); ``cpu``: its host devices.
    Every one unless ``ranks`` asks for fewer.
    """
    import jax

    platform = "gpu" if device == "cuda" else "cpu"
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise ValueError(f"--device {device}: jax {jax.__version__} has no {platform} backend "
                         f"(jax.devices({platform!r}): {e}; JAX_PLATFORMS="
                         f"{os.environ.get('JAX_PLATFORMS', '(unset)')!r}; a GPU needs jax[cuda12])") from None
    if ranks is not None and ranks > len(devices):
        raise ValueError(f"--ranks {ranks}: jax has {len(devices)} {platform} device{'s' * (len(devices) != 1)}")
    return devices if ranks is None else devices[:ranks]


class TorchDevice:
    """One torch rank's device: the ``torch.device`` to build on, waiting for it, and its
    allocator's live and peak bytes.

    On CUDA, torch's caching allocator counts (``memory_allocated``, ``max_memory_allocated``
    after ``reset_peak_memory_stats``): bytes of live tensors, not what the cache holds. On the CPU,
    which keeps no such counts, ``hybrid.bench._live`` counts every allocation (installed here,
    so count only what is allocated after this is made).
    """

    def __init__(self, kind: str, rank: int):
        import torch

        self.torch = torch
        if kind == "cuda":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
            self.name = torch.cuda.get_device_name(rank)
        else:
            from hybrid.bench import _live
            _live.install()
            self._live = _live
            self.device = torch.device("cpu")
            self.name = f"CPU, {torch.get_num_threads()} torch threads"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Wait until the device has run everything queued (a no-op on the CPU)."""
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return self.torch.cuda.memory_allocated(self.device) if self.is_cuda else self._live.live_bytes()

    def reset_peak(self) -> None:
        if self.is_cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._live.reset_peak()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated(self.device) if self.is_cuda else self._live.peak_bytes()

    def release(self) -> None:
        """Give freed blocks back (CUDA's cache), so the next variant's build starts from the same place."""
        if self.is_cuda:
            self.torch.cuda.empty_cache()
