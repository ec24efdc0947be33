"""The parity harness on the NNX twin: ``hybrid.parity`` takes an ``nnx.State`` pair as it takes
linen's. From torch's weights (through ``GPT_MAPPING``), ``NNXGPT`` trains as ``FlaxGPT`` does
under ``zero`` at stages 1 and 3 (whose parity with torch tests/parity/test_harness.py pins), on
the same plan. No torch ranks are started: the torch module only gives its weights and its
gradient-ready order."""

import numpy as np
import pytest

import hybrid.parity as hp
from hybrid.models import GPT_MAPPING
from tests.parity import _pairs

OPTIMIZER = hp.OptimizerSpec("adamw", lr=3e-3, weight_decay=0.1, eps=1e-6)


def nnx_gpt():
    from flax import nnx
    from hybrid.models import NNXGPT, nnx_loss
    # shapes only, as _pairs.flax_gpt's jax.eval_shape: the harness replaces the values by torch's
    # (an eager NNX init ran a compiled kernel per initialiser, seconds of CPU)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: NNXGPT(_pairs.gpt_config(), rngs=nnx.Rngs(0))), nnx.Param)
    return params, lambda p, batch: nnx_loss(nnx.merge(graphdef, p), batch[0], batch[1])


@pytest.fixture(scope="module")
def setups():
    """The NNX and the linen pair, prepared once for both stages (the same torch weights and batches)."""
    return [hp.prepare(_pairs.torch_gpt, pair, _pairs.gpt_data, steps=4, mapping=GPT_MAPPING, optimizer=OPTIMIZER)
            for pair in (nnx_gpt, _pairs.flax_gpt)]


@pytest.mark.parametrize("stage", [1, 3])
def test_nnx_pair_trains_as_the_linen_pair(stage, setups):
    from flax import nnx
    assert isinstance(setups[0].jax_params, nnx.State)
    nnx_run, linen_run = (hp.train_jax(s, num_devices=2, stage=stage) for s in setups)
    # the same float32 network in one framework: only the trees' leaf orders differ (h.0 / h_0)
    report = hp.compare(linen_run, nnx_run, tolerance=hp.Tolerance(loss_rtol=1.3e-6, loss_atol=1e-6,
                                                                    param_rtol=1.3e-6, param_atol=5e-7))
    hp.assert_parity(report)  # losses, every parameter by torch's name, and one plan (torch's)
    assert nnx_run.plan_fingerprint == linen_run.plan_fingerprint
    assert np.isfinite(nnx_run.losses).all()
