"""``python -m hybrid plan`` on every source: in a subprocess as a user runs it where the process
is the subject (its exit, the tables on a terminal's stdout, a module found from the folder it runs
in, a closed pipe), otherwise ``hybrid.cli.main`` in this process with its stdout, stderr and
exit code captured the same way (a fresh interpreter per call was most of this file's time)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hybrid.models import EXAMPLES
from hybrid.core import partition_params, plan_buckets


ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_cli_process(*args, cwd=None):
    # PYTHONPATH: the checkout's hybrid, installed or not, also when run from another directory.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hybrid", "plan", *args], capture_output=True, text=True,
                          cwd=cwd, env=env)


def run_cli(*args, cwd=None):
    """``python -m hybrid plan ARGS`` as :func:`run_cli_process` reports it, run in this process:
    the exit code (argparse's ``SystemExit`` included; an uncaught error is 1 and its traceback on
    stderr, as the interpreter does), stdout and stderr. ``cwd``: run there, with that folder first
    on ``sys.path`` as ``python -m`` puts it (a ``--module`` found there is forgotten after)."""
    import contextlib
    import io
    import traceback

    from hybrid import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
            stack.callback(_forget_modules_from, str(cwd), set(sys.modules))
            sys.path.insert(0, str(cwd))
        try:
            code = cli.main(["plan", *args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except Exception:  # noqa: BLE001 - as the interpreter reports it
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["plan", *args], code or 0, out.getvalue(), err.getvalue())


def _forget_modules_from(folder: str, before: set) -> None:
    """Undo a run in ``folder``: off ``sys.path``, and the modules it imported from there gone."""
    sys.path.remove(folder)
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(folder):
            del sys.modules[name]


@pytest.mark.parametrize("model", sorted(EXAMPLES))
def test_builtin_examples_json_matches_the_core(model):
    out = run_cli("--model", model, "--world-size", "3", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    specs = EXAMPLES[model]()
    plan = plan_buckets(specs)
    assert report["fingerprint"] == plan.fingerprint()
    assert [b["tensors"] for b in report["buckets"]] == [len(b.members) for b in plan.buckets]
    assert [r["params_owned"] for r in report["ranks"]] == partition_params(specs, 3).numel_per_rank()
    # ZeRO-1 state per rank sums to the unsharded state: nothing lost, nothing counted twice.
    assert sum(r["zero1_state_bytes"] for r in report["ranks"]) == report["state_bytes_per_param"] * report["num_params"]


def test_default_prints_tables():
    out = run_cli_process()
    assert out.returncode == 0, out.stderr
    assert "gpt2-small" in out.stdout and "wte.weight" in out.stdout and "ZeRO-2 total" in out.stdout


def test_specs_file(tmp_path):
    path = tmp_path / "specs.json"
    path.write_text(json.dumps([{"name": "a", "shape": [1000, 1000], "dtype": "float32"},
                                {"name": "b", "shape": [10], "dtype": "bfloat16", "device": "cuda:0"}]))
    out = run_cli("--specs", str(path), "--bucket-cap-mb", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {(b["dtype"], b["device"]) for b in report["buckets"]} == {("float32", "cpu"), ("bfloat16", "cuda:0")}


def test_torch_module_factory(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "    m[0].bias.requires_grad_(False)  # frozen parameters are not planned, as in DDP\n"
        "    return m\n")
    out = run_cli("--module", "mymodels:make", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["num_tensors"] == 3 and report["num_params"] == 32 + 16 + 2


@pytest.mark.parametrize("args, message", [
    (["--specs", "/nonexistent/specs.json"], "/nonexistent/specs.json"),
    (["--module", "no_such_module_xyz:make"], "no_such_module_xyz"),
    (["--module", "missingcolon"], "PKG.MOD:FACTORY"),
    (["--world-size", "0"], "--world-size"),
    (["--bucket-cap-mb", "-1"], "--bucket-cap-mb"),
])
def test_bad_input_names_the_culprit(args, message):
    out = run_cli(*args)
    assert out.returncode != 0 and message in out.stderr


def test_bad_spec_in_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"name": "a", "shape": [3], "dtype": "float99"}]))
    out = run_cli("--specs", str(path))
    assert out.returncode != 0 and "float99" in out.stderr


def test_caps_printed_are_the_caps_used():
    # torch's DDP caps the first bucket at bucket_cap_mb when one is given, and drops a first-bucket
    # cap that is not below the cap; the plan does too, and so must the text: every bucket of
    # --bucket-cap-mb 0.02 is filled to 20.48 KiB, none to 1 MiB.
    out = run_cli("--model", "mlp", "--bucket-cap-mb", "0.02")
    assert out.returncode == 0, out.stderr
    caps_line = next(line for line in out.stdout.splitlines() if line.startswith("Buckets"))
    assert "cap 20.48 KiB for every bucket" in caps_line and "ignored" not in caps_line
    out = run_cli("--model", "mlp", "--bucket-cap-mb", "0.02", "--first-bucket-cap-mb", "1")
    caps_line = next(line for line in out.stdout.splitlines() if line.startswith("Buckets"))
    assert "cap 20.48 KiB for every bucket" in caps_line and "ignored" in caps_line
    report = json.loads(run_cli("--model", "mlp", "--bucket-cap-mb", "0.02", "--json").stdout)
    assert report["size_limits"] == [int(0.02 * 2**20)]
    assert {b["size_limit"] for b in report["buckets"]} == {int(0.02 * 2**20)}
    default = run_cli("--model", "mlp").stdout
    assert "caps 1.00 MiB for the first bucket of each dtype and device, then 25.00 MiB" in default


def test_output_explains_its_words_and_points_onwards():
    text = run_cli("--model", "mlp").stdout
    helptext = run_cli("--help").stdout
    for out in (text, helptext):
        for word in ("fingerprint", "flat shard", "imbalance", "paper formulas", "python -m hybrid demo",
                     "examples/torch_train.py", "torchrun", "examples/jax_train.py"):
            assert word in out, word
    assert text.rstrip().endswith("are training scripts to start from.")


def test_closed_pipe_ends_quietly(tmp_path):
    # Like `python -m hybrid plan | head -1`: the reader goes away after one line. The output
    # (one bucket per tensor, thousands of rows) is far larger than a pipe's buffer.
    path = tmp_path / "specs.json"
    path.write_text(json.dumps([{"name": f"t{i}", "shape": [1000], "dtype": "float32"} for i in range(4000)]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "hybrid", "plan", "--specs", str(path), "--bucket-cap-mb", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline().startswith(str(path).encode())
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) != 0 and stderr == "", stderr


def test_compile_lists_pieces_next_to_the_buckets(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "compmodels.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)\n"
        "    def forward(self, x):\n"
        "        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))\n"
        "def make():\n"
        "    return Net()\n")
    # Caps of c's and b's bytes: each linear closes its piece and its bucket (weight and bias).
    out = run_cli("--module", "compmodels:make", "--compile", "--bucket-cap-mb", str(1088 / 2**20),
                  "--first-bucket-cap-mb", str(272 / 2**20), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)["compile"]
    assert view["input_shape"] == [2, 8]   # from the first Linear
    (graph,) = view["graphs"]
    assert graph["compiled_whole"] is None
    assert [p["params"] for p in graph["pieces"]] == view["buckets"] == [
        ["c.weight", "c.bias"], ["b.weight", "b.bias"], ["a.weight", "a.bias"]]
    text = run_cli("--module", "compmodels:make", "--compile", "--input-shape", "3,8", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "on one input of shape (3, 8): 1 graph(s)" in text.stdout and "compiled whole" in text.stdout


def test_compile_needs_a_torch_module():
    out = run_cli("--model", "gpt2-small", "--compile")
    assert out.returncode != 0 and "--module PKG.MOD:FACTORY or --model mlp" in out.stderr


def test_project_json_rows_and_volumes(tmp_path):
    from hybrid.core import COLLECTIVES, CostModel
    samples = [(k, n, 1e-4 + n * 2e-9) for k in COLLECTIVES for n in (1 << 12, 1 << 20, 1 << 25)]
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(CostModel.fit(samples, world_size=2, about={"backend": "gloo"}).to_json()))
    out = run_cli("--model", "mlp", "--project", "--ranks", "8,64", "--cost", str(cost), "--json")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)["projection"]
    assert len(p["rows"]) == 4 * 2 * 4  # (3 named networks + measured) x 2 world sizes x 4 stages
    psi = sum(s.nbytes for s in EXAMPLES["mlp"]())
    ddp8 = next(r for r in p["rows"] if (r["network"], r["ranks"], r["stage"]) == ("ib400", 8, "ddp"))
    assert ddp8["bytes_sent_per_rank"] == pytest.approx(2 * 7 / 8 * psi)
    z3 = next(r for r in p["rows"] if (r["network"], r["ranks"], r["stage"]) == ("ib400", 8, "zero3"))
    assert z3["bytes_sent_per_rank"] == pytest.approx(1.5 * ddp8["bytes_sent_per_rank"])
    assert all(0 <= r["exposed_s"] <= r["comm_s"] + 1e-12 for r in p["rows"])
    assert "gloo at 2 ranks" in p["networks"]["measured"]


@pytest.mark.parametrize("args,message", [(["--ranks", "0"], "--ranks must all be >= 1"),
                                          (["--ranks", "8,x"], "--ranks wants comma-separated integers"),
                                          (["--mfu", "1.5"], "--mfu must be in (0, 1]"),
                                          (["--tokens", "0"], "--tokens must be > 0"),
                                          (["--cost", "/nonexistent.json"], "not a readable CostModel")])
def test_project_refuses_bad_options(args, message):
    out = run_cli("--project", *args)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_project_prints_every_network():
    out = run_cli("--project", "--ranks", "8")
    assert out.returncode == 0, out.stderr
    for name in ("NVLink-class", "400 Gb/s InfiniBand", "100 GbE", "exposed"):
        assert name in out.stdout


def test_zero3_view_matches_the_core():
    # Stage 3's memory and every stage's bytes per step, as the core computes them; the keys are
    # additions: the stage-1/2 keys above stay as they were.
    from hybrid.core import STAGES, shard_flat, step_cost, zero3_memory

    out = run_cli("--model", "mlp", "--world-size", "8", "--prefetch", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    plan = plan_buckets(EXAMPLES["mlp"]())
    k = report["state_bytes_per_param"]
    m = zero3_memory(shard_flat(plan, 8), k, prefetch=2)
    assert report["zero3_bytes_per_rank"] == {"param_bytes": m.param_bytes, "grad_bytes": m.grad_bytes,
                                              "state_bytes": m.state_bytes, "gathered_bytes": m.gathered_bytes,
                                              "total_bytes": m.total}
    assert report["forward_order"] == list(reversed(range(plan.num_buckets))) and report["prefetch"] == 2
    assert report["formula_bytes_per_rank"]["zero3"] == pytest.approx(
        (2 * report["param_bytes"] + k * report["num_params"]) / 8)
    sent = report["sent_bytes_per_rank_per_step"]
    for stage in STAGES:
        key = stage if stage == "ddp" else f"zero{stage}"
        assert sent[key] == step_cost(plan, 8, stage, lambda kind, n: 0.0, forward_s=0, backward_s=0).wire_bytes
    assert sent["zero3"] == pytest.approx(1.5 * sent["ddp"]) and sent["zero3_kept"] == pytest.approx(sent["ddp"])
    text = run_cli("--model", "mlp", "--world-size", "8").stdout
    assert "ZeRO-3 per rank" in text and "kept for the backward" in text and "1.50x" in text


def test_negative_prefetch_is_refused():
    out = run_cli("--prefetch", "-1")
    assert out.returncode != 0 and "--prefetch must be >= 0" in out.stderr
