"""JAX's host devices for a command, asked for before JAX starts (it fixes its CPU device count then)."""

from __future__ import annotations

import os
import sys


def ask_host_devices(n: int, *, cpu: bool) -> None:
    """Ask XLA for ``n`` host CPU devices, unless JAX is imported already or ``XLA_FLAGS`` asks for
    a count of its own; ``cpu``: also run JAX on the CPU unless ``JAX_PLATFORMS`` says otherwise
    (the demo does, always; ``parity`` only where it sets the count)."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    asked = "xla_force_host_platform_device_count" in flags
    if not asked:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    if cpu or not asked:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
