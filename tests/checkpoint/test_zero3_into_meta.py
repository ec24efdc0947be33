"""A checkpoint loads straight into the slices of a ZeRO3 model built on the meta device (issue 36,
item 2): no rank materialises the model, and none reads more of the files than its own elements.

Two sources, each loaded by a 2-rank meta-built ``ZeRO3(TorchGPT)`` + ``ZeRO3Optimizer(Adam)``:
- a torch checkpoint of the same GPT (a plain model and Adam after two steps, written by one
  process as 3 ranks' files): the oracle is that model's ``state_dict()`` and Adam's state, bit for
  bit;
- a JAX stage-3 checkpoint of the flax twin (``hybrid.demo``'s GPT run: ``shard_params`` over
  torch's names and layouts through ``hybrid.models.GPT_MAPPING``, 3 devices, another plan than
  ZeRO3's): the oracle is the checkpoint read whole by ``hybrid.checkpoint.torch.state_dicts``.

Memory per rank while loading: torch tensors counted by the allocator (``hybrid.bench._live``;
Adam's two moments of this rank's slices are new), numpy arrays by tracemalloc (the elements read:
this rank's slices of the parameters and of two moments, and the 1 MiB chunks their checksums
cover, all dropped once copied), below the whole parameters and moments.
"""

import tracemalloc

import numpy as np
import pytest
import torch

from hybrid.models import GPTConfig, TorchGPT
from tests._procs import forkserver_ranks, init_gloo

GPT = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128)  # 0.83 M parameters
CHUNK = 1 << 20  # the checksum chunk of a shard file


def _meta_zero3():
    from hybrid.torch import ZeRO3, ZeRO3Optimizer

    with torch.device("meta"):
        model = TorchGPT(GPT)
    zero3 = ZeRO3(model, init_fn=model.init_weights)  # GPT-2's init, a module at a time: replaced by the load
    return zero3, ZeRO3Optimizer(zero3, torch.optim.Adam, lr=1e-3)


def _load(path, rank, port, out):
    from hybrid.bench import _live
    from hybrid.checkpoint import torch as checkpoint

    _live.install()
    init_gloo(rank, port)
    model, opt = _meta_zero3()
    slice_bytes = sum(s.numel() * 4 for s in model._buckets.slices)
    before = _live.live_bytes()
    _live.reset_peak()
    tracemalloc.start()
    step = checkpoint.load(path, model, opt)
    numpy_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    torch_peak = _live.peak_bytes() - before
    params = {k[len("module."):]: v.numpy() for k, v in model.state_dict().items()}
    state = opt.state_dict()
    moments = {k: v["exp_avg"].numpy() for k, v in state["state"].items()}
    out.put((rank, dict(step=step, params=params, moments=moments, slice_bytes=slice_bytes, torch_peak=torch_peak,
                        numpy_peak=numpy_peak), 0.0))


def _torch_checkpoint(path):
    from hybrid.checkpoint import torch as checkpoint

    torch.manual_seed(0)
    model = TorchGPT(GPT)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(2):
        idx = torch.randint(0, GPT.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model, opt, step=2, world_size=3)
    state = opt.state_dict()["state"]
    return ({k: v.detach().numpy() for k, v in model.state_dict().items()},
            {i: st["exp_avg"].numpy() for i, st in state.items()})


def _check_memory(r):
    model_state = 16 * GPT.num_params()  # parameters, gradients and Adam's two moments, float32
    print(f"slices {r['slice_bytes']} B; while loading: torch peak {r['torch_peak']} B, numpy peak "
          f"{r['numpy_peak']} B; the model's state {model_state} B")
    assert r["torch_peak"] <= 2 * r["slice_bytes"] + (64 << 10), r  # Adam's moments of the slices
    assert r["numpy_peak"] <= 3 * r["slice_bytes"] + 4 * CHUNK, r  # the elements read, and their chunks
    assert r["numpy_peak"] < 12 * GPT.num_params()  # the whole parameters and moments: never read


@pytest.mark.timeout(170)
def test_torch_checkpoint_into_meta_built_zero3(tmp_path, live_counter):
    want_params, want_moments = _torch_checkpoint(tmp_path / "torch")
    reports, _ = forkserver_ranks(_load, (str(tmp_path / "torch"),), 2, wait_s=150)
    for rank, (r, _) in sorted(reports.items()):
        assert r["step"] == 2
        assert list(r["params"]) == list(want_params)
        for name, value in want_params.items():
            np.testing.assert_array_equal(r["params"][name], value, err_msg=name)
        for i, value in want_moments.items():
            np.testing.assert_array_equal(r["moments"][i], value, err_msg=f"exp_avg of parameter {i}")
        _check_memory(r)


@pytest.mark.timeout(170)
def test_jax_stage3_checkpoint_through_the_mapping_into_meta_built_zero3(tmp_path, live_counter):
    from hybrid.checkpoint.torch import state_dicts
    from hybrid.demo import TrainConfig, train_jax

    train_jax(TrainConfig(gpt=GPT, seq_len=16, global_batch_size=6, num_steps=2, stage=3), num_devices=3,
              save_to=str(tmp_path / "jax3"), save_at=2)
    want, _ = state_dicts(tmp_path / "jax3")
    reports, _ = forkserver_ranks(_load, (str(tmp_path / "jax3"),), 2, wait_s=150)
    for rank, (r, _) in sorted(reports.items()):
        assert r["step"] == 2
        assert set(want) <= set(r["params"]), set(want) - set(r["params"])  # lm_head.weight: wte.weight, tied
        for name, value in want.items():
            np.testing.assert_array_equal(r["params"][name], value.numpy(), err_msg=name)
        _check_memory(r)
