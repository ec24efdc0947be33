"""``python -m hybrid plan --jax``: the GPT pair's plan through GPT_MAPPING, against torch's own DDP.

The oracle is torch's ``DistributedDataParallel`` after its rebuild (the inspector runs it when
given the torch half and a batch) and, independently here, ``hybrid.jax``'s own layout of the same
tree, pairing and ready order: names, bucket membership and fingerprint must be equal exactly.
"""

import json

import pytest
import torch

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
    from hybrid.parity._bridge import observed_ready_order, pair_models
    from hybrid.parity._spec import tree_map

    params, loss = _pairs.flax_gpt()
    module, torch_loss = _pairs.torch_gpt()
    # with --torch the pairing carries torch's own order, observed on step 0's batch
    observed = observed_ready_order(module, torch_loss, tree_map(torch.from_numpy, _pairs.gpt_data(0)))
    pairing = pair_models(module, params, GPT_MAPPING).with_torch_ready(observed)
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
    assert "Tensors on both sides, bucket by bucket (torch's own gradient-ready order" in out.stdout
    assert ("torch's own DistributedDataParallel after its rebuild (2 steps, 1 gloo rank, as built at these flags): "
            "the same 1 bucket(s)") in out.stdout


def test_without_the_torch_half_names_are_derived_by_the_rules():
    report = _json("--jax", JAX, "--mapping", MAPPING)
    module, _ = _pairs.torch_gpt()
    assert {r["torch"] for r in report["pairing"]["tensors"]} == {n for n, _ in module.named_parameters()}
    assert report["pairing"]["order"] == "leaves" and "torch_check" not in report["pairing"]


def test_a_different_plan_is_reported_with_its_first_bucket():
    """The check can fail: the registration-order plan (what torch's DDP holds before its rebuild)
    against torch's rebuilt buckets."""
    from hybrid.cli._plan_pair import _torch_check
    from hybrid.core import plan_buckets
    from hybrid.torch import specs

    from hybrid.cli._plan_options import Caps

    module, loss = _pairs.torch_gpt()
    caps = Caps(bucket_cap_mb=0.02)  # given: torch's first bucket is capped at 0.02 MiB too
    before_rebuild = plan_buckets(specs(module), bucket_cap_bytes=caps.bucket_cap_bytes,
                                  first_bucket_cap_bytes=caps.first_bucket_cap_bytes)
    check = _torch_check((module, loss), _pairs.gpt_data(0), before_rebuild, caps)
    assert not check["equal"] and check["first_difference"] == 0


# ---- a pair over 1 MiB at default flags (the outsider GPT, 6.1 MiB): torch's first bucket is 1 MiB ----

WIDE = ("--jax", "tests.parity._outsider:flax_wide", "--mapping", "tests.parity._outsider:WIDE_MAPPING",
        "--data", "tests.parity._outsider:data")


@pytest.fixture(scope="module")
def wide_with_torch():
    return _json(*WIDE, "--torch", "tests.parity._outsider:torch_wide")


@pytest.fixture(scope="module")
def wide_with_torch_text():
    """The tables a user reads, for the tests below that check them (one run, not one per test)."""
    out = run_cli(*WIDE, "--torch", "tests.parity._outsider:torch_wide")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def wide_text():
    """The tables without the torch half (one run for the tests that read them)."""
    out = run_cli(*WIDE)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_default_flags_run_torch_as_a_user_would(wide_with_torch, wide_with_torch_text):
    """No --bucket-cap-mb: torch's DDP is built without bucket_cap_mb (an explicit 25 would cap its
    first bucket at 25 MiB too, and the check would report a difference that is not there)."""
    check, section = wide_with_torch["pairing"]["torch_check"], wide_with_torch["pairing"]
    assert check["equal"], check
    assert len(check["torch_buckets"]) == len(wide_with_torch["buckets"]) == 2
    assert wide_with_torch["size_limits"] == [MiB, 25 * MiB]
    assert section["order"] == "torch" and section["rules_order_agrees"] == {"equal": True}
    text = wide_with_torch_text
    assert "torch's own gradient-ready order, observed on one step of the torch half" in text
    assert "as built at these flags): the same 2 bucket(s), tensor for tensor" in text
    assert "DIFFERS" not in text


def test_an_explicit_cap_caps_torchs_first_bucket_too():
    report = _json(*WIDE, "--torch", "tests.parity._outsider:torch_wide", "--bucket-cap-mb", "2")
    assert report["size_limits"] == [2 * MiB] and report["pairing"]["torch_check"]["equal"]


def test_zero3_fingerprint_is_zero3s_own(wide_with_torch, wide_with_torch_text, wide_text):
    """What ``parity --stage 3`` reports: the plan hybrid.torch.ZeRO3 builds over the torch half."""
    import datetime

    import torch.distributed as dist

    from hybrid.demo._torch_run import free_port
    from hybrid.torch import ZeRO3
    from tests.parity import _outsider

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        assert wide_with_torch["zero3_fingerprint"] == ZeRO3(_outsider.torch_wide()[0]).bucket_plan.fingerprint()
    finally:
        dist.destroy_process_group()
    assert f"parity --stage 3 reports: plan {wide_with_torch['zero3_fingerprint']}" in wide_with_torch_text
    # without the torch half there is no registration order: the tree's leaf order stands in, and it says so
    assert "ZeRO-3's plan above follows torch's registration order only with --torch" in wide_text


def test_without_the_torch_half_the_assumed_order_is_named(wide_text):
    report = _json(*WIDE)
    assumed = report["pairing"]["assumed_together"]
    assert report["pairing"]["order"] == "ready" and "torch_check" not in report["pairing"]
    assert assumed["blocks.0.ln1"] == "norm-like" and assumed["ln_f"] == "rule" and "blocks.0.attn.qkv" not in assumed
    text = wide_text
    assert "Assumed, with no torch half to observe" in text and "blocks.7.ln2 (norm-like" in text


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
