"""The GPT training-step benches (``bench ddp | zero | jax --device``, ``bench summary``) as far as
a machine without a GPU can take them: the options and their errors, the refusal to run on a
device that is not there (naming what is missing), GPT-2 small and its plans, and the very code
a GPU run uses, run on the CPU (gloo ranks, host devices) on the tiny config."""

from __future__ import annotations

import json
import re
import types

import jax
import pytest
import torch
import torch.distributed as dist

from hybrid.bench import ddp, jax as jax_bench, summary, zero
from hybrid.bench.gpt import StepBench, _device, _jax, _report, _torch
from hybrid.core import TensorSpec, plan_buckets, zero3_plan
from hybrid.models import GPTConfig, TorchGPT
from tests._procs import forkserver_context
from tests.bench.test_output import _aa_rows
from tests.torch.test_ddp_kernels import single_rank_group

TINY = ["--model", "tiny", "--batch", "2", "--seq", "16", "--quick", "--reps", "2"]


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("main, argv, message", [
    (ddp.main, ["--model", "tiny"], "--model only with --device (cpu or cuda)"),
    (zero.main, ["--json", "x.json", "--seq", "8"], "--seq, --json only with --device"),
    (ddp.main, ["--device", "cpu", "--dtypes", "fp16"], "--dtypes must be distinct names of float32, bf16, got 'fp16'"),
    (ddp.main, ["--device", "cpu", "--dtypes", "bf16,bf16"], "got 'bf16,bf16'"),
    (ddp.main, ["--device", "cpu", "--model", "tiny", "--seq", "500"], "--seq 500 is longer than tiny's block_size 128"),
    (ddp.main, ["--device", "cpu", "--batch", "0"], "--batch must be an int >= 1, got 0"),
    (zero.main, ["--device", "cpu", "--ranks", "0"], "--ranks must be an int >= 1, got 0"),
    (zero.main, ["--device", "cpu", "--widths", "8,8"], "--widths: the MLP's, not taken with --device"),
    (jax_bench.main, ["--copy-backend", "cuda"], "--copy-backend only with --device"),
    (jax_bench.main, ["--device", "cpu", "--ranks", "9"], "--ranks 9: jax has 4 cpu devices"),
])
def test_bad_options_are_usage_errors_that_name_them(main, argv, message, capsys):
    assert message in _usage_error(main, argv, capsys)


def test_defaults_are_gpt2_small_at_8_x_1024_tokens_both_dtypes():
    bench = StepBench("cuda")
    assert (bench.gpt, bench.tokens_per_rank, bench.dtypes, bench.reps) == (GPTConfig.gpt2(), 8192, ("float32", "bf16"), 20)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing to refuse")
@pytest.mark.parametrize("main", [ddp.main, zero.main])
def test_torch_benches_refuse_cuda_without_a_gpu(main, capsys):
    err = _usage_error(main, ["--device", "cuda", "--quick"], capsys)
    assert "--device cuda: no CUDA GPU is visible: torch.cuda.is_available() is False" in err
    assert torch.__version__ in err


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="jax has a GPU here")
def test_jax_bench_refuses_cuda_without_a_gpu_backend(capsys):
    err = _usage_error(jax_bench.main, ["--device", "cuda"], capsys)
    assert f"--device cuda: jax {jax.__version__} has no gpu backend" in err and "jax[cuda12]" in err


def test_ranks_on_cuda_are_one_per_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert _device.torch_ranks("cuda", None) == 1
    with pytest.raises(ValueError, match="--ranks 2: NCCL needs a GPU per rank, and 1 GPU is visible"):
        _device.torch_ranks("cuda", 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match="built without NCCL"):
        _device.torch_ranks("cuda", None)


def test_gpt2_small_and_its_plans():
    with torch.device("meta"):  # shapes only: nothing allocated
        model = TorchGPT(GPTConfig.gpt2())
    named = list(model.named_parameters())
    assert sum(p.numel() for _, p in named) == 124_439_808 == GPTConfig.gpt2().num_params()
    assert len(named) == 148 and model.lm_head.weight is model.wte.weight  # the head tied: counted once
    specs = [TensorSpec(n, tuple(p.shape), "float32") for n, p in named]
    plan = plan_buckets(specs)
    # hybrid's DDP buckets are the ones torch's DDP gives its Reducer (the reverse of the assignment)
    indices, _ = dist._compute_bucket_assignment_by_size([p for _, p in named], [dist._DEFAULT_FIRST_BUCKET_BYTES,
                                                                                25 << 20], [False] * len(named))
    assert [list(b.members) for b in plan.buckets] == [list(b) for b in reversed(indices)]
    assert plan.num_buckets == 14
    assert zero3_plan(specs).num_buckets == 13


def _records(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)["records"]


def _check_run(out: str, variants, dtypes):
    for dtype in dtypes:
        for name in variants:
            assert re.search(rf"^{dtype}\s+{name}\s+\d+\.\d\d\s", out, re.M), (dtype, name, out)
    return _aa_rows(out)


def _forkserver_spawn(fn, args=(), nprocs=1, join=True):
    """torch.multiprocessing.spawn's call, its ranks forked from the test run's preloaded
    forkserver (tests/_procs.py) instead of fresh interpreters each importing torch: the ranks run
    the bench's own worker, only their start is cheaper."""
    forkserver_context()  # the server's preload list
    return torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """bench ddp at one gloo rank (the lent GPU's world), both dtypes; bench zero at two, bf16."""
    tmp = tmp_path_factory.mktemp("gpt")
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_torch, "mp", types.SimpleNamespace(spawn=_forkserver_spawn))
        for name, main, argv in [("ddp", ddp.main, []), ("zero", zero.main, ["--ranks", "2", "--dtypes", "bf16"])]:
            path = tmp / f"{name}.json"
            with _Captured() as out:
                assert main(["--device", "cpu", *TINY, *argv, "--json", str(path)]) == 0
            runs[name] = (out.text, path)
    return runs


class _Captured:
    """stdout of a block, as capsys gives a test (a module fixture cannot take capsys)."""

    def __enter__(self):
        import contextlib
        import io
        self._buf = io.StringIO()
        self._redirect = contextlib.redirect_stdout(self._buf)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)
        self.text = self._buf.getvalue()


def test_ddp_on_cpu_runs_the_gpu_code(torch_runs):
    out, path = torch_runs["ddp"]
    assert "bench ddp --device cpu: GPT tiny: 940,800 parameters in 52 tensors, batch 2 x 16 tokens per rank" in out
    assert "tiny, 1 rank (gloo)" in out and "hybrid_ddp: 2 buckets, bucket copies by torch (no kernels)" in out
    aa = _check_run(out, ["torch_ddp", "hybrid_ddp"], ["float32", "bf16"])
    assert [(r["group"], r["what"]) for r in aa] == [("float32, torch_ddp", "torch_ddp'/torch_ddp"),
                                                     ("bf16, torch_ddp", "torch_ddp'/torch_ddp")]
    recs = _records(path)
    assert [(r["dtype"], r["ours"], r["reference"], len(r["ours_s"]), r["memory_goal"]) for r in recs] == [
        ("float32", "hybrid_ddp", "torch_ddp", 2, False), ("bf16", "hybrid_ddp", "torch_ddp", 2, False)]
    # params, AdamW's two moments and DDP's bucket: the same bytes held by both classes
    for r in recs:
        assert r["ours_peak"] > 4 * 4 * 940_800 and r["reference_peak"] > 4 * 4 * 940_800


def test_zero_on_cpu_runs_the_gpu_code_at_two_ranks(torch_runs):
    out, path = torch_runs["zero"]
    assert "tiny, 2 ranks (gloo)" in out and re.search(r"hybrid_zero3: \d+ buckets", out)
    aa = _check_run(out, ["torch_zero1", "hybrid_zero1", "fsdp2", "hybrid_zero3"], ["bf16"])
    assert [r["what"] for r in aa] == ["torch_zero1'/torch_zero1", "fsdp2'/fsdp2"]
    recs = _records(path)
    assert [(r["ours"], r["reference"], r["memory_goal"]) for r in recs] == [
        ("hybrid_zero1", "torch_zero1", False), ("hybrid_zero3", "fsdp2", True)]


def test_jax_on_host_devices_runs_the_gpu_code(tmp_path, capsys):
    path = tmp_path / "jax.json"
    assert jax_bench.main(["--device", "cpu", *TINY, "--dtypes", "bf16", "--ranks", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tiny, 2 x cpu; jax" in out and "bucket copies by jnp (reference)" in out
    aa = _check_run(out, ["unsharded_adamw", "zero1_adamw", "zero2_adamw", "zero3_adamw"], ["bf16"])
    assert [(r["group"], r["what"]) for r in aa] == [("bf16, unsharded_adamw", "unsharded_adamw'/unsharded_adamw")]
    recs = _records(path)
    assert [r["ours"] for r in recs] == ["zero1_adamw", "zero2_adamw", "zero3_adamw"]
    by = {r["ours"]: r for r in recs}
    # stage 3 keeps a slice of the params too: XLA plans less for its step than for the unsharded one
    assert by["zero3_adamw"]["ours_peak"] < by["zero3_adamw"]["reference_peak"]


def test_summary_is_one_table_of_the_goals(torch_runs, capsys):
    assert summary.main([str(torch_runs["ddp"][1]), str(torch_runs["zero"][1])]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [re.split(r" {2,}", line) for line in lines[2:7]]
    assert [r[:3] for r in rows[:4]] == [["ddp", "hybrid_ddp/torch_ddp", "float32"],
                                         ["ddp", "hybrid_ddp/torch_ddp", "bf16"],
                                         ["zero", "hybrid_zero1/torch_zero1", "bf16"],
                                         ["zero", "hybrid_zero3/fsdp2", "bf16"]]
    assert all(r[6] in ("yes", "noise", "no") for r in rows[:4])
    assert rows[3][8] in ("yes", "no") and rows[0][8] == "-"  # the memory goal is ZeRO3's alone
    assert lines[6].startswith("runs: ddp: tiny, 1 rank (gloo)")


def test_summary_names_a_file_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    assert f"{bad}: not the --json of a GPT training-step bench (KeyError" in _usage_error(summary.main, [str(bad)], capsys)
    empty = tmp_path / "empty.json"
    empty.write_text('{"records": []}')
    assert "no records in" in _usage_error(summary.main, [str(empty)], capsys)


class _Uncounted:
    """A CPU rank without the allocator count (installed, it would count for the rest of this
    test process): memory reads 0, which this test does not look at."""

    device, is_cuda, name = torch.device("cpu"), False, "CPU"

    def sync(self):
        pass

    reset_peak = release = sync

    def allocated(self):
        return 0

    peak = allocated


def test_a_failing_variant_is_reported_and_the_others_timed(monkeypatch):
    real = _torch.build

    def build(name, bench, device):
        if name == "hybrid_zero1":
            raise RuntimeError("no such luck")
        return real(name, bench, device)

    monkeypatch.setattr(_torch, "build", build)
    bench = StepBench("cpu", model="tiny", batch=2, seq=8, reps=2, warmup=0)
    pairs = _torch.ZERO_PAIRS["1-2"] + _torch.DDP_PAIRS
    idx = torch.randint(bench.gpt.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with single_rank_group("gloo"):
        res = _torch.measure(bench, pairs, _Uncounted(), (idx[:, :-1], idx[:, 1:]), "float32")
    assert res["failed"] == {"hybrid_zero1": "RuntimeError: no such luck"}
    assert {name: len(t) for name, t in res["times"].items()} == {"torch_ddp": 2, "hybrid_ddp": 2, "torch_ddp'": 2}
    results = [{"dtypes": {"float32": res}}]
    assert "FAILED float32 hybrid_zero1: RuntimeError: no such luck" in _report.measured(results, pairs)
    recs = _report.records("zero", "here", results, pairs, memory="none")
    assert recs[0]["failed"] == "hybrid_zero1: RuntimeError: no such luck" and "ours_s" in recs[1]
    table = _report.summary(recs)
    assert re.search(r"zero\s+hybrid_zero1/torch_zero1\s+float32\s+FAILED", table), table
    assert "FAILED zero float32 hybrid_zero1/torch_zero1: hybrid_zero1: RuntimeError: no such luck" in table


def test_jax_variants_that_fail_to_compile_are_reported(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("does not lower")

    monkeypatch.setattr(_jax._steps, "compile_steps", broken)
    monkeypatch.setattr(_jax._steps, "compile_zero3", broken)
    bench = StepBench("cpu", model="tiny", batch=1, seq=8, dtypes=("float32",), reps=1, warmup=0)
    res = _jax.measure(bench, jax.devices()[:1])
    failed = res["dtypes"]["float32"]["failed"]
    assert failed == dict.fromkeys(["unsharded_adamw", "zero1_adamw", "zero2_adamw", "zero3_adamw"],
                                   "ValueError: does not lower")
    assert all("failed" in r for r in _report.records("jax", "here", [res], _jax.PAIRS, memory="none"))
