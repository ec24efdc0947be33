"""What the benchmarks print: every one ends in the same ratio table, with an A/A row per group and
the legend (hybrid.bench._stats.ratio_table). Real runs for the cheap benches (pack, a tiny jax);
the report functions of the multi-process benches on known series, which pins what their A/A row
divides by what."""

import re

import pytest

from hybrid.bench import compile as compile_bench, ddp, jax as jax_bench
from hybrid.bench.checkpoint import _command as checkpoint
from hybrid.bench.pack import _command as pack
from hybrid.bench.zero import _command as zero, _zero3

HEADER = re.compile(r"ratio of times\s+paired\s+middle half\s+of medians\s+better")
AA = re.compile(r"^(?P<group>.*?)\s+A/A \(noise\) (?P<what>.+?)\s+(?P<paired>[\d.]+)\s+(?P<lo>[\d.]+)-(?P<hi>[\d.]+)"
                r"\s+(?P<medians>[\d.]+)\s+1 = no noise$", re.M)
LEGEND = ("paired: the median over the repetitions of one path's time over the other's in the same repetition",
          "middle half: first to third quartile of those per-repetition ratios",
          "A/A (noise): the same path against itself in this run",
          "cannot be told from noise")


def _aa_rows(text: str) -> list[dict]:
    assert HEADER.search(text), text
    flat = " ".join(text.split())
    for words in LEGEND:
        assert words in flat, (words, text)
    return [m.groupdict() for m in AA.finditer(text)]


def _sane(row):
    # Noise on a shared 2-core machine can be large, but a same-path median ratio off by 20x means
    # the row divides the wrong series (pack/copy on small tensors is ~0.003) or mixes units. The
    # spread's top is one rep's ratio: a single preempted microsecond rep reached 57x in a run.
    lo, paired, hi = float(row["lo"]), float(row["paired"]), float(row["hi"])
    assert 0.05 < lo <= paired <= hi and paired < 20, row


def test_pack_prints_an_aa_row_per_interleaved_pair(capsys):
    shapes = pack.small_shapes(40)
    rows = pack._run_numpy("tiny", shapes, reps=5) + pack._run_torch("tiny", shapes, "cpu", "reference", reps=5)
    print(pack.report(rows))
    out = capsys.readouterr().out
    aa = _aa_rows(out)
    assert [r["group"] for r in aa] == ["tiny, numpy core pack", "tiny, numpy core unpack",
                                        "tiny, torch reference pack", "tiny, torch reference unpack"]
    assert {r["what"] for r in aa} == {"copy'/copy"}
    for r in aa:
        _sane(r)
    assert "copy/pack" in out and "> 1: pack faster" in out


def test_jax_prints_an_aa_row(capsys):
    code = jax_bench.main(["--width", "64", "--depth", "2", "--batch", "8", "--reps", "3", "--steps", "1", "--skip-zero"])
    out = capsys.readouterr().out
    assert code == 0
    [aa] = _aa_rows(out)
    assert (aa["group"], aa["what"]) == ("[1] sgd", "psum_sgd'/psum_sgd")
    _sane(aa)
    assert "bucketed_sgd/psum_sgd" in out and "< 1: bucketed_sgd faster" in out


def test_jax_jit_part_prints_gspmd_rows_and_an_aa_row(capsys):
    code = jax_bench.main(["--jit-only", "--jit-width", "32", "--jit-depth", "2", "--jit-batch", "8",
                           "--jit-reps", "2", "--jit-steps", "1"])
    out = capsys.readouterr().out
    assert code == 0
    [aa] = _aa_rows(out)
    assert (aa["group"], aa["what"]) == ("[3] jit", "replicated'/replicated")
    for row in ("jit_zero2/gspmd_zero1", "jit_zero3/gspmd_fsdp", "sm_zero3/gspmd_fsdp"):
        assert row in out
    assert "reduce-scatter" in out.split("jit_zero3    temporaries")[1].splitlines()[0]


def _series(base, factor):
    return [base * factor] * 3


def test_ddp_report_aa_is_torch_against_itself():
    times = {"torch": _series(1.0, 1), "hybrid": _series(1.0, 0.9), "torch'": _series(1.0, 1.05),
             "per_tensor": _series(1.0, 2.7), "auto": _series(1.0, 0.72)}
    out = ddp.report([("mlp_2M", 2101248, 16, times, 2, "3 buckets (2 in place)")])
    [aa] = _aa_rows(out)
    assert (aa["group"], aa["what"], aa["paired"], aa["lo"], aa["hi"]) == ("mlp_2M", "torch'/torch", "1.050", "1.050", "1.050")
    assert re.search(r"mlp_2M\s+hybrid/torch\s+0\.900 .*< 1: hybrid faster", out), out
    assert re.search(r"mlp_2M\s+per_tensor/hybrid\s+3\.000 .*> 1: hybrid faster", out), out
    # auto caps paired with torch's default caps in the same reducer, and with torch's DDP
    assert re.search(r"mlp_2M\s+auto/hybrid\s+0\.800 .*< 1: auto faster", out), out
    assert re.search(r"mlp_2M\s+auto/torch\s+0\.720 .*< 1: auto faster", out), out
    assert "auto on mlp_2M: 3 buckets (2 in place)" in out


def test_zero_report_aa_is_torch_zero1_against_itself():
    times = {name: _series(0.06, 1 + i / 100) for i, name in enumerate(zero.ROUND)}
    times["torch_zero1'"] = _series(0.06, 0.98 * 1.01)   # torch_zero1 is the second of the round: 1.01
    out = zero.step_report(times)
    [aa] = _aa_rows(out)
    assert (aa["what"], aa["paired"]) == ("torch_zero1'/torch_zero1", "0.980")
    # auto caps against the same ZeRO at torch's default caps: 1.09 / 1.02 and 1.10 / 1.04
    assert re.search(r"hybrid_zero1_auto/hybrid_zero1\s+1\.069 ", out), out
    assert re.search(r"hybrid_zero2_auto/hybrid_zero2\s+1\.058 ", out), out


def test_zero_stage3_report_aa_is_ddp_against_itself_per_model_and_world():
    times = {name: _series(0.05, 1 + i / 10) for i, name in enumerate(_zero3.ROUND)}
    times["ddp_adam'"] = _series(0.05, 1.02)
    memory = {name: {"held": 100 * (i + 1), "peak": 200 * (i + 1)} for i, name in enumerate(_zero3.VARIANTS)}
    memory["hybrid_zero3"].update(buckets=4, working_set=64)
    memory["hybrid_zero3_memory"].update(buckets=8, working_set=16)
    rank = {"mlp": {"times": times, "memory": memory}}
    results = {("mlp", 2): [rank, rank], ("mlp", 3): [rank, rank, rank]}
    out = _zero3.step_report(results)
    aa = _aa_rows(out)
    assert [(r["group"], r["what"], r["paired"]) for r in aa] == [
        ("mlp, 2 ranks", "ddp_adam'/ddp_adam", "1.020"), ("mlp, 3 ranks", "ddp_adam'/ddp_adam", "1.020")]
    assert re.search(r"mlp, 2 ranks\s+hybrid_zero3/ddp_adam\s+1\.300 .*< 1: hybrid_zero3 faster", out), out
    table = _zero3.memory_report(results)
    assert re.search(r"mlp\s+3\s+hybrid_zero3\s+400 B\s+4\.000\s+800 B\s+4\.000\s+4 buckets, working set 64 B",
                     table), table
    assert re.search(r"mlp\s+3\s+hybrid_zero3_memory\s+500 B\s+5\.000\s+1000 B\s+5\.000\s+8 buckets, working set 16 B",
                     table), table


def test_compile_report_aa_is_split_against_itself():
    times = {"split": _series(0.03, 1), "whole": _series(0.03, 1.1), "split'": _series(0.03, 1.02),
             "eager": _series(0.03, 0.9), "torch": _series(0.03, 1.0)}
    res = {"times": times, "first": dict.fromkeys(("split", "whole", "eager", "torch"), 1.0),
           "graphs": {"split": 1, "whole": 1, "eager": 0, "torch": 1},
           "first_frames": {"split": 4, "whole": 1, "eager": 0, "torch": 40}, "frames": 0}
    out = compile_bench.report(res)
    [aa] = _aa_rows(out)
    assert (aa["what"], aa["paired"]) == ("split'/split", "1.020")
    assert re.search(r"split/whole\s+0\.909 .*< 1: split faster", out), out


@pytest.mark.parametrize("reps", [1, 4])
def test_checkpoint_aa_is_neighbouring_plain_io(capsys, reps):
    # plain write alternates 10 ms / 12 ms: each repetition over the one before is 1.2 or 1/1.2.
    write = [0.010, 0.012, 0.010, 0.012][:reps]
    times = {"save": [2 * w for w in write], "plain write": write, "load": [0.02] * reps, "plain read": [0.01] * reps}
    checkpoint._report("torch", {"times": times, "written": 10 << 20, "read": 20 << 20, "num_params": 1000}, goal=True)
    out = capsys.readouterr().out
    aa = _aa_rows(out)
    assert "each repetition of the reference path over the repetition before it" in " ".join(out.split())
    if reps == 1:
        assert aa == [] and out.count("needs more repetitions") == 2
        return
    assert [(r["group"], r["what"]) for r in aa] == [("save", "plain write'/plain write"), ("load", "plain read'/plain read")]
    # ratios 1.2, 0.833, 1.2: median 1.2; quartiles (0.833 + 1.2) / 2 and 1.2
    assert (aa[0]["paired"], aa[0]["lo"], aa[0]["hi"]) == ("1.200", "1.017", "1.200")
    assert re.search(r"save\s+save/plain write\s+2\.000 .*< 1: save faster", out), out


def test_checkpoint_formats_rows_divide_by_hybrids_own(capsys):
    from hybrid.bench.checkpoint import _dcp_orbax as formats

    own = [0.010, 0.012, 0.010, 0.012]
    times = {"hybrid save": own, "dcp save": [2 * t for t in own], "hybrid load": [0.005] * 4,
             "load dcp": [0.010] * 4, "dcp load": [0.015] * 4}
    formats.report("torch", {"times": times, "sizes": {"hybrid": 10 << 20, "dcp": 10 << 20}, "num_params": 1000},
                   formats.TORCH_RATIOS)
    out = capsys.readouterr().out
    aa = _aa_rows(out)
    assert [(r["group"], r["what"]) for r in aa] == [("save", "hybrid save'/hybrid save"),
                                                     ("load", "hybrid load'/hybrid load")]
    assert re.search(r"save\s+dcp save/hybrid save\s+2\.000 .*< 1: dcp save faster", out), out
    assert re.search(r"load\s+load dcp/hybrid load\s+2\.000", out) and re.search(r"dcp load/hybrid load\s+3\.000", out)
