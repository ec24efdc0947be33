"""Benchmarks: ``python -m hybrid bench NAME``. Each module NAME here exposes ``main(argv) -> int``.

Every benchmark measures A and B side by side in one run (interleaved, several repetitions,
medians) and prints their ratio: these machines are too noisy for absolute timings.
"""
