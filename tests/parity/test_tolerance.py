"""Per-tensor tolerances of a parity report: a named tensor held to its own pair, the rest to the
run's; a pattern that matches nothing is an error, not a tolerance that silently holds nothing."""

import numpy as np
import pytest

from hybrid.parity import ParityReport, SideRun, Tolerance, assert_parity, compare

BIAS = "h.0.attn.c_attn.bias"


def _runs(drift: float):
    params = {BIAS: np.zeros(96, np.float32), "h.0.attn.c_attn.weight": np.ones((96, 32), np.float32)}
    moved = {**params, BIAS: params[BIAS] + np.float32(drift)}  # the key bias moved by rounding noise
    return SideRun("torch", 0, (1.0, 0.9), params, "f", 0.0), SideRun("jax", 0, (1.0, 0.9), moved, "f", 0.0)


def test_a_tensor_held_to_its_own_tolerance():
    torch_run, jax_run = _runs(2.6e-5)  # 2.6x the default atol, as the GPT pair's key bias at eps 1e-8
    assert compare(torch_run, jax_run).param_breaks == (BIAS,)
    loose = Tolerance(per_tensor={"h.*.attn.c_attn.bias": (1e-4, 1e-4)})
    report = compare(torch_run, jax_run, tolerance=loose)
    assert report.ok and report.param_breaks == ()
    assert_parity(report)
    assert "1 pattern(s) with their own" in report.summary()
    # the other tensors keep the run's tolerance: a drift there still breaks
    torch_run, jax_run = _runs(0.0)
    jax_run.params["h.0.attn.c_attn.weight"] = torch_run.params["h.0.attn.c_attn.weight"] + np.float32(1e-3)
    assert compare(torch_run, jax_run, tolerance=loose).param_breaks == ("h.0.attn.c_attn.weight",)


def test_the_report_keeps_them_through_json():
    torch_run, jax_run = _runs(2.6e-5)
    report = compare(torch_run, jax_run, tolerance=Tolerance(per_tensor={BIAS: (0.0, 1e-4)}))
    again = ParityReport.from_json(report.dumps())
    assert again.tolerance == report.tolerance and again.ok


@pytest.mark.parametrize("per_tensor, message", [
    ({"h.*.mlp.bias": (1e-3, 1e-4)}, r"patterns \['h.\*.mlp.bias'\] match no tensor"),
])
def test_a_pattern_matching_nothing_is_an_error(per_tensor, message):
    with pytest.raises(ValueError, match=message):
        compare(*_runs(0.0), tolerance=Tolerance(per_tensor=per_tensor))


@pytest.mark.parametrize("per_tensor, message", [
    ({BIAS: (1e-3,)}, "wants"),
    ({BIAS: (1e-3, -1.0)}, r"per_tensor\['h.0.attn.c_attn.bias'\] must be a finite number >= 0"),
    ({"": (1e-3, 1e-4)}, "wants"),
    ({BIAS: (float("nan"), 1e-4)}, "must be a finite number"),
])
def test_bad_entries_name_themselves(per_tensor, message):
    with pytest.raises(ValueError, match=message):
        Tolerance(per_tensor=per_tensor)


def test_the_headline_says_what_failed():
    """Plans DIFFERENT with the values within tolerance: the first line says FAILED and why, not
    "parity ok" above a body that contradicts it (and the assertion raises with it)."""
    torch_run, jax_run = _runs(0.0)
    other_plan = SideRun("jax", 0, jax_run.losses, jax_run.params, "g", 0.0)
    report = compare(torch_run, other_plan)
    assert report.ok and not report.plans_match  # the values agree: only the plans differ
    assert report.summary().splitlines()[0] == "parity FAILED (the bucket plans differ): jax against torch, steps 0..1"
    with pytest.raises(AssertionError, match=r"^parity FAILED \(the bucket plans differ\)"):
        assert_parity(report)
    assert_parity(report, plans=False)  # told to skip the plans; the report still says what it saw
    torch_run, jax_run = _runs(1e-3)
    worse = compare(torch_run, SideRun("jax", 0, (1.0, 0.95), jax_run.params, "g", 0.0))
    assert worse.headline == "parity FAILED (losses from step 1; 1 of 2 tensors; the bucket plans differ)"
    assert compare(*_runs(0.0)).headline == "parity ok"
