"""Benchmarks: ``python -m hybrid bench NAME``. Each NAME here exposes ``main(argv) -> int``.

A module per command without helpers of its own (``ddp``, ``compile``, ``summary``), a package per
command with them (``zero/``, ``jax/``, ``pack/``, ``checkpoint/``: its ``_command`` parses the
arguments, its other modules are its parts), and what several commands share: ``gpt/`` (the GPT
training steps of ``ddp``, ``zero`` and ``jax`` with ``--device``, and ``summary``'s table),
``_stats`` (the ratio table every benchmark prints) and ``_live`` (the CPU allocator's live bytes).

Every benchmark measures A and B side by side in one run (interleaved in an order that rotates
every repetition, several repetitions, medians) and prints their ratio: these machines are too
noisy for absolute timings. Each ends in
the same table (``_stats.ratio_table``): paired ratios, which side of 1 is better, an A/A row (the
reference path against itself in the same run) that shows what noise alone does, and a legend.
"""
