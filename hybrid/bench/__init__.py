"""Benchmarks: ``python -m hybrid bench NAME``. Each module NAME here exposes ``main(argv) -> int``.

Every benchmark measures A and B side by side in one run (interleaved in an order that rotates
every repetition, several repetitions, medians) and prints their ratio: these machines are too
noisy for absolute timings. Each ends in
the same table (``_stats.ratio_table``): paired ratios, which side of 1 is better, an A/A row (the
reference path against itself in the same run) that shows what noise alone does, and a legend.
"""
