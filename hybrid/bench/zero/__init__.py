"""``python -m hybrid bench zero``: ZeRO-1, -2 and -3 memory per rank, and step time, vs DDP + Adam.

    _command          the arguments, and the ZeRO-1/2 part: torch's DDP + Adam and
                      ZeroRedundancyOptimizer beside hybrid's ZeRO-1, ZeRO2 and the overlap hooks
    _zero3            the stage-3 part: ZeRO-3 beside DDP, FSDP2, ZeRO-1 and ZeRO-2
    _zero3_budget     ``--part budget``: a meta-built model no rank can hold, under a per-rank budget
    _zero3_budget_jax its JAX side, run as ``python -m hybrid.bench.zero._zero3_budget_jax``
    _zero3_compile    ``--part compile``: compiled ZeRO3 beside compiled FSDP2 (a Llama, blocks compiled)

With ``--device`` it times GPT training steps instead (``hybrid.bench.gpt``).
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    """Run the benchmark with its command-line arguments (``--help`` lists them); 0 when done.

    ``_command`` is imported here, not at the top: the JAX side of ``--part budget`` runs in a
    process of its own inside this package and must not import torch.

    >>> from hybrid.bench import zero
    >>> callable(zero.main)
    True
    """
    from hybrid.bench.zero._command import main as run

    return run(argv)
