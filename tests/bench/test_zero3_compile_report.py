"""What ``python -m hybrid bench zero --part compile`` prints, on known series: the A/A row is
compiled FSDP2 against itself, every variant is divided by compiled FSDP2, and compiled ZeRO3 is
also divided by eager ZeRO3 (the two goals of issue 44)."""

import re

from hybrid.bench.zero import _zero3_compile as compiled


def _series(base: float, scale: float, n: int = 5) -> list[float]:
    return [base * scale * (1 + k / 100) for k in range(n)]


def test_compile_report_divides_by_compiled_fsdp2_and_by_eager_zero3():
    times = {name: _series(0.05, 1 + i / 10) for i, name in enumerate(compiled.ROUND)}
    times["fsdp2_compiled'"] = _series(0.05, 1.02)
    model = {"times": times, "losses": {name: [4.0, 3.9] for name in compiled.VARIANTS},
             "graphs": {name: 2 for name in compiled.VARIANTS}, "recompiles": 0, "params": 10}
    out = compiled.report({("llama", 2): [{"llama": model}]})
    assert re.search(r"llama, 2 ranks\s+A/A \(noise\) fsdp2_compiled'/fsdp2_compiled\s+1\.020 ", out), out
    assert re.search(r"hybrid_zero3_compiled/fsdp2_compiled\s+1\.100 .*< 1: hybrid_zero3_compiled faster", out), out
    # hybrid_zero3 is the 4th variant (1.3), hybrid_zero3_compiled the 2nd (1.1): 1.1 / 1.3
    assert re.search(r"hybrid_zero3_compiled/hybrid_zero3\s+0\.846 ", out), out
    assert re.search(r"hybrid_zero3_compiled_whole/hybrid_zero3\s+0\.923 ", out), out  # 1.2 / 1.3
    assert "frames compiled in the timed steps: 0" in out
