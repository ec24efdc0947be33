"""One ``python -m hybrid demo`` run as plain values: what the command builds from its arguments,
and what its report (``_demo_report``) reads."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class DemoOptions:
    """One demo run, as plain values (what the command line asks for, its defaults filled in)."""

    model: str = "gpt"
    steps: int = 40
    world_size: int = 2
    resume_world_size: int = 3
    save_at: int = 20
    stage: int = 1
    optimizer: str = "adam"
    lr: float = 3e-3
    batch_size: int = 12
    seed: int = 0
    out: str = ""
