"""hybrid.checkpoint.jax with ``mapping=``: the flax GPT's tree saved and loaded under the torch
GPT's names and layouts, so each framework reads the other's checkpoint of the model pair.

Every crossing is a relayout of the same float32 values (transposes), so each is checked bitwise:
torch's parameters and Adam moments, and ``hybrid.jax.zero``'s flat buckets, against what the
other side holds, through the pairing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import Mesh, PartitionSpec as P

import hybrid.jax as hj
from hybrid.checkpoint import jax as ckpt_jax
from hybrid.checkpoint import torch as ckpt_torch
from hybrid.core import MappingError, unpack
from hybrid.models import GPT_MAPPING, FlaxGPT, GPTConfig, TorchGPT, flax_loss
from hybrid.parity import named_jax, pair_models

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _torch_run(steps=2):
    torch.manual_seed(0)
    model = TorchGPT(CONFIG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    idx = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(idx, idx)[1].backward()
        opt.step()
    return model, opt


def _flax_zeros(config=CONFIG):
    shapes = jax.eval_shape(FlaxGPT(config).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _torch_moments(model, opt, key):
    return {n: opt.state[p][key].numpy() for n, p in model.named_parameters()}


def _assert_crossed(pairing, torch_arrays: dict, jax_tree):
    """The JAX tree holds torch's arrays, relaid through the pairing, bit for bit."""
    got = pairing.to_torch(named_jax(jax_tree))
    assert list(got) == list(torch_arrays)
    for name, value in torch_arrays.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


def test_a_torch_checkpoint_loads_into_the_flax_tree_and_optax_state(tmp_path):
    model, opt = _torch_run()
    ckpt_torch.save(tmp_path / "t", model, opt, step=2, world_size=2)
    params = _flax_zeros()
    state = optax.adam(1e-2).init(params)
    params, state, step = ckpt_jax.load(tmp_path / "t", params, state, mapping=GPT_MAPPING)
    pairing = pair_models(model, params, GPT_MAPPING)
    assert step == 2 and int(state[0].count) == 2
    _assert_crossed(pairing, {n: p.detach().numpy() for n, p in model.named_parameters()}, params)
    _assert_crossed(pairing, _torch_moments(model, opt, "exp_avg"), state[0].mu)
    _assert_crossed(pairing, _torch_moments(model, opt, "exp_avg_sq"), state[0].nu)
    # The resolved pairing works as the mapping too.
    again, _, _ = ckpt_jax.load(tmp_path / "t", _flax_zeros(), mapping=pairing)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)))


def test_a_flax_checkpoint_loads_into_the_torch_model_and_optimizer(tmp_path):
    model, opt = _torch_run()
    ckpt_torch.save(tmp_path / "t", model, opt, step=2)
    params, state, _ = ckpt_jax.load(tmp_path / "t", _flax_zeros(), optax.adam(1e-2).init(_flax_zeros()),
                                     mapping=GPT_MAPPING)
    # JAX saves under torch's names, derived from the mapping alone (in the tree's order), or
    # from a pairing made with the torch module (in its registration order); torch loads either.
    torch_order = [n for n, _ in model.named_parameters()]
    manifest = ckpt_jax.save(tmp_path / "j", params, state, step=2, world_size=3, mapping=GPT_MAPPING)
    assert sorted(s.name for s in manifest.plan.specs) == sorted(torch_order)
    manifest = ckpt_jax.save(tmp_path / "j", params, state, step=2, world_size=3,
                             mapping=pair_models(model, params, GPT_MAPPING))
    assert [s.name for s in manifest.plan.specs] == torch_order
    torch.manual_seed(5)
    fresh = TorchGPT(CONFIG)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert ckpt_torch.load(tmp_path / "j", fresh, fresh_opt) == 2
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.lm_head.weight is fresh.wte.weight
    for key in ("exp_avg", "exp_avg_sq"):
        mine, theirs = _torch_moments(model, opt, key), _torch_moments(fresh, fresh_opt, key)
        assert all(np.array_equal(mine[n], theirs[n]) for n in mine), key


def _zero_state(params, n, **plan):
    mesh = Mesh(np.array(jax.devices()[:n]), ("dp",))
    tx = hj.zero(optax.adam(1e-2), "dp", **(plan or dict(bucket_cap_bytes=4096, first_bucket_cap_bytes=4096)))
    specs = hj.state_specs(tx, params, "dp", axis_size=n)
    return jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)


def test_a_zero_state_crosses_through_the_mapping(tmp_path):
    caps = dict(bucket_cap_bytes=4096, first_bucket_cap_bytes=4096)
    model, opt = _torch_run()
    ckpt_torch.save(tmp_path / "t", model, opt, step=2, world_size=2)
    params = _flax_zeros()
    zero = _zero_state(params, 3)
    params, zero, step = ckpt_jax.load(tmp_path / "t", params, zero, mapping=GPT_MAPPING, **caps)
    # The flat buckets hold torch's moments: unpack them with the zero's plan and compare.
    layout = hj._specs._Layout.of(params, what="test", order=None, **caps)
    pairing = pair_models(model, params, GPT_MAPPING)
    adam = zero.inner[0]
    assert step == 2 and int(adam.count) == 2 and len(adam.mu) == len(layout.plan.buckets) > 1
    assert {d.id for d in adam.mu[0].sharding.device_set} == {d.id for d in jax.devices()[:3]}
    for slot, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        whole = {layout.plan.specs[i].name: a for b, flat in enumerate(getattr(adam, slot))
                 for i, a in unpack(layout.plan, b, np.asarray(flat)).items()}
        torch_side = pairing.to_torch(whole)
        expected = _torch_moments(model, opt, key)
        assert all(np.array_equal(torch_side[n], expected[n]) for n in expected), slot
    # ... and save back under torch's names, from the zero's 3 devices into 3 files, then into torch.
    manifest = ckpt_jax.save(tmp_path / "z", params, zero, step=2, stage=1, mapping=GPT_MAPPING, **caps)
    assert manifest.world_size == 3
    fresh = TorchGPT(CONFIG)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    ckpt_torch.load(tmp_path / "z", fresh, fresh_opt)
    for key in ("exp_avg", "exp_avg_sq"):
        mine, theirs = _torch_moments(model, opt, key), _torch_moments(fresh, fresh_opt, key)
        assert all(np.array_equal(mine[n], theirs[n]) for n in mine), key
    # JAX to JAX through torch's names: the same flat buckets, bit for bit.
    _, again, _ = ckpt_jax.load(tmp_path / "z", _flax_zeros(), _zero_state(_flax_zeros(), 3), mapping=GPT_MAPPING,
                                **caps)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(zero)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _torch_saved_and_flax_plan(path):
    """torch's run saved at ``path`` (2 ranks, step 2), and what a flax zero state planned as its DDP
    needs: zero flax params, their pairing with the torch model, the JAX backward's ready order."""
    model, opt = _torch_run()
    ckpt_torch.save(path, model, opt, step=2, world_size=2)
    params = _flax_zeros()
    idx = jnp.zeros((2, 8), jnp.int32)
    ready = hj.gradient_ready_order(lambda p: flax_loss(FlaxGPT(CONFIG), p, idx, idx), params)
    return model, opt, params, pair_models(model, params, GPT_MAPPING), ready


def test_a_zero_state_planned_as_torchs_ddp_crosses_at_other_device_counts(tmp_path):
    """``zero(..., ready_order=, pairing=)`` (torch's rebuilt plan at torch's default caps, its
    buckets over torch's names and layouts): loaded from torch's checkpoint on 3 devices, saved from
    there, loaded on 2 devices and by torch; every crossing bit for bit."""
    model, opt, params, pairing, ready = _torch_saved_and_flax_plan(tmp_path / "t")

    def zero_state(n):
        tx = hj.zero(optax.adam(1e-2), "dp", ready_order=ready, pairing=pairing)
        mesh = Mesh(np.array(jax.devices()[:n]), ("dp",))
        specs = hj.state_specs(tx, params, "dp", axis_size=n)
        return jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    # torch's plan differs from the one the tree's own names give: the load must find zero's
    layout = hj._specs._Layout.of(params, what="test", order=None, bucket_cap_bytes=25 << 20,
                                  first_bucket_cap_bytes=1 << 20, ready_order=ready, pairing=pairing)
    plain = hj._specs._Layout.of(params, what="test", order=None, bucket_cap_bytes=25 << 20,
                                 first_bucket_cap_bytes=1 << 20, ready_order=ready)
    assert layout.plan.fingerprint() != plain.plan.fingerprint()
    def assert_holds_torchs_moments(zero):
        # zero's buckets hold torch's tensors in torch's layouts: unpacked, they are torch's as they are
        adam = zero.inner[0]
        assert int(adam.count) == 2
        for slot, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            whole = {layout.plan.specs[i].name: a for b, flat in enumerate(getattr(adam, slot))
                     for i, a in unpack(layout.plan, b, np.asarray(flat)).items()}
            expected = _torch_moments(model, opt, key)
            assert all(np.array_equal(whole[n], expected[n]) for n in expected), slot

    loaded, zero3, step = ckpt_jax.load(tmp_path / "t", params, zero_state(3), mapping=pairing, ready_order=ready)
    assert step == 2
    assert_holds_torchs_moments(zero3)
    ckpt_jax.save(tmp_path / "z", loaded, zero3, step=2, stage=1, mapping=pairing, ready_order=ready)
    _, zero2, _ = ckpt_jax.load(tmp_path / "z", params, zero_state(2), mapping=pairing, ready_order=ready)
    assert len({d.id for d in zero2.inner[0].mu[0].sharding.device_set}) == 2
    assert_holds_torchs_moments(zero2)
    fresh = TorchGPT(CONFIG)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert ckpt_torch.load(tmp_path / "z", fresh, fresh_opt) == 2
    for key in ("exp_avg", "exp_avg_sq"):
        mine, theirs = _torch_moments(model, opt, key), _torch_moments(fresh, fresh_opt, key)
        assert all(np.array_equal(mine[n], theirs[n]) for n in mine), key


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensors(tmp_path):
    model, opt = _torch_run()
    ckpt_torch.save(tmp_path / "t", model, opt, step=2)
    one_layer = _flax_zeros(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(MappingError, match=r"torch tensor 'h.1.ln_1.weight' has no jax counterpart \(nearest: "
                                           r"'h_0.ln_1.scale'"):
        ckpt_jax.load(tmp_path / "t", one_layer, mapping=GPT_MAPPING)
    with pytest.raises(TypeError, match="mapping must be a hybrid.core.ParamMapping or ParamPairing, got dict"):
        ckpt_jax.load(tmp_path / "t", _flax_zeros(), mapping={"wte.embedding": "wte.weight"})


def test_a_zero_state_planned_over_torchs_names_takes_torchs_checkpoint_as_it_is(tmp_path):
    """zero(ready_order=, pairing=) plans as torch's DDP does, over torch's names and layouts: its
    state needs no mapping; save and load take the arguments zero took and cross bit for bit."""
    model, opt, params, pairing, ready = _torch_saved_and_flax_plan(tmp_path / "t")
    plan = dict(ready_order=ready, pairing=pairing, bucket_cap_bytes=4096, first_bucket_cap_bytes=4096)  # several buckets
    params, zero, step = ckpt_jax.load(tmp_path / "t", params, _zero_state(params, 3, **plan), **plan)
    _assert_crossed(pairing, {n: p.detach().numpy() for n, p in model.named_parameters()}, params)
    layout = hj._specs._Layout.of(params, what="test", order=None, **plan)
    adam = zero.inner[0]
    assert step == 2 and int(adam.count) == 2 and len(adam.mu) == len(layout.plan.buckets) > 1
    for slot, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        # the buckets hold torch's tensors in torch's layouts, under torch's names
        whole = {layout.plan.specs[i].name: a for b, flat in enumerate(getattr(adam, slot))
                 for i, a in unpack(layout.plan, b, np.asarray(flat)).items()}
        expected = _torch_moments(model, opt, key)
        assert sorted(whole) == sorted(expected) and all(np.array_equal(whole[n], expected[n]) for n in expected), slot
    manifest = ckpt_jax.save(tmp_path / "z", params, zero, step=2, stage=1, **plan)
    assert manifest.world_size == 3 and manifest.plan == layout.plan
    fresh = TorchGPT(CONFIG)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert ckpt_torch.load(tmp_path / "z", fresh, fresh_opt) == 2
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for key in ("exp_avg", "exp_avg_sq"):
        mine, theirs = _torch_moments(model, opt, key), _torch_moments(fresh, fresh_opt, key)
        assert all(np.array_equal(mine[n], theirs[n]) for n in mine), key
    with pytest.raises(ValueError, match="give mapping= or pairing=, not both"):
        ckpt_jax.load(tmp_path / "t", params, zero, mapping=GPT_MAPPING, **plan)
