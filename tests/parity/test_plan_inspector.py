"""``python -m hybrid plan --jax``: the GPT pair's plan through GPT_MAPPING, against torch's own DDP.

The oracle is torch's ``DistributedDataParallel`` after its rebuild (the inspector runs it when
given the torch half and a batch) and, independently here, ``hybrid.jax``'s own layout of the same
tree, pairing and ready order: names, bucket membership and fingerprint must be equal exactly.
"""

import json

import pytest

from hybrid.core import MiB
from hybrid.models import GPT_MAPPING
from tests.cli.test_plan_cli import run_cli
from tests.parity import _pairs

JAX, TORCH, DATA = "tests.parity._pairs:flax_gpt", "tests.parity._pairs:torch_gpt", "tests.parity._pairs:gpt_data"
MAPPING = "hybrid.models:GPT_MAPPING"


def _json(*args):
    out = run_cli(*args, "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def at_small_caps():
    """The pair at a 20 KiB cap, so the 30 tensors fill 4 buckets (at torch's defaults they fit one)."""
    return _json("--jax", JAX, "--torch", TORCH, "--mapping", MAPPING, "--data", DATA, "--bucket-cap-mb", "0.02")


def test_plan_equals_torch_ddp_after_its_rebuild(at_small_caps):
    check = at_small_caps["pairing"]["torch_check"]
    assert check["equal"], check
    assert len(check["torch_buckets"]) == len(at_small_caps["buckets"]) == 4


def test_plan_is_the_one_hybrid_jax_builds(at_small_caps):
    from hybrid.jax import gradient_ready_order
    from hybrid.jax._specs import _Layout
    from hybrid.parity._bridge import pair_models

    params, loss = _pairs.flax_gpt()
    module, _ = _pairs.torch_gpt()
    pairing = pair_models(module, params, GPT_MAPPING)
    layout = _Layout.of(params, what="test", order=None, ready_order=gradient_ready_order(loss, params, _pairs.gpt_data(0)),
                        pairing=pairing, bucket_cap_bytes=int(0.02 * MiB), first_bucket_cap_bytes=MiB)
    assert at_small_caps["fingerprint"] == layout.plan.fingerprint()
    assert at_small_caps["pairing"]["pairing_fingerprint"] == pairing.fingerprint()
    rows = at_small_caps["pairing"]["tensors"]
    assert [r["torch"] for r in rows] == [layout.plan.specs[m].name for b in layout.plan.buckets for m in b.members]


def test_every_tensor_is_listed_with_both_names_layout_and_rule(at_small_caps):
    rows = {r["torch"]: r for r in at_small_caps["pairing"]["tensors"]}
    module, _ = _pairs.torch_gpt()
    assert set(rows) == {n for n, _ in module.named_parameters()}  # the tied LM head once, as torch
    kernel = rows["h.0.mlp.c_fc.weight"]
    assert (kernel["jax"], kernel["jax_shape"], kernel["torch_shape"], kernel["layout"]) == \
        ("h_0.mlp.c_fc.kernel", [32, 128], [128, 32], "transpose(1, 0)")
    assert "Dense" in kernel["rule"]
    assert rows["ln_f.weight"]["jax"] == "ln_f.scale" and rows["wte.weight"]["jax"] == "wte.embedding"


def test_default_caps_and_tables():
    out = run_cli("--jax", JAX, "--torch", TORCH, "--mapping", MAPPING, "--data", DATA)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Tensors on both sides, bucket by bucket (the JAX backward's gradient-ready order" in out.stdout
    assert "torch's own DistributedDataParallel after its rebuild (2 steps, 1 gloo rank, same caps): the same 1 bucket(s)" \
        in out.stdout


def test_without_the_torch_half_names_are_derived_by_the_rules():
    report = _json("--jax", JAX, "--mapping", MAPPING)
    module, _ = _pairs.torch_gpt()
    assert {r["torch"] for r in report["pairing"]["tensors"]} == {n for n, _ in module.named_parameters()}
    assert report["pairing"]["order"] == "leaves" and "torch_check" not in report["pairing"]


def test_a_different_plan_is_reported_with_its_first_bucket():
    """The check can fail: the registration-order plan (what torch's DDP holds before its rebuild)
    against torch's rebuilt buckets."""
    from hybrid._plan_pair import _torch_check
    from hybrid.core import plan_buckets
    from hybrid.torch import specs

    class Args:
        bucket_cap_mb, first_bucket_cap_mb = 0.02, 1.0

    module, loss = _pairs.torch_gpt()
    before_rebuild = plan_buckets(specs(module), bucket_cap_bytes=int(0.02 * MiB), first_bucket_cap_bytes=MiB)
    check = _torch_check((module, loss), _pairs.gpt_data(0), before_rebuild, Args)
    assert not check["equal"] and check["first_difference"] == 0


@pytest.mark.parametrize("args, message", [
    (["--torch", TORCH], "--torch goes with --jax"),
    (["--jax", JAX, "--mapping", "tests.parity._pairs:VOCAB"], "is a int, not a hybrid.core.ParamMapping"),
    (["--jax", JAX, "--torch", TORCH, "--mapping", "tests.parity._pairs:MLP_MAPPING"], "wte.embedding"),
    (["--jax", "tests.parity._pairs:nothing"], "has no 'nothing'"),
    (["--jax", JAX, "--compile"], "give --module, not --jax"),
])
def test_bad_input_names_the_culprit(args, message):
    out = run_cli(*args)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
