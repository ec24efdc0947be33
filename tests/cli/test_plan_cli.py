"""``python -m hybrid plan`` on every source, in a subprocess as a user runs it."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hybrid._examples import EXAMPLES
from hybrid.core import partition_params, plan_buckets


ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_cli(*args, cwd=None):
    # PYTHONPATH: the checkout's hybrid, installed or not, also when run from another directory.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hybrid", "plan", *args], capture_output=True, text=True,
                          cwd=cwd, env=env)


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
    out = run_cli()
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
