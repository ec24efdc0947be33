"""The GPT pair's JAX half: ``hybrid.models``' flax GPT as a :class:`~hybrid.demo.JaxModel`.

The flax tree keeps flax's names and layouts (``h_0.attn.c_attn.kernel``, ``(in, out)``); the
declared mapping (``hybrid.models.GPT_MAPPING``) pairs it with the torch model's parameters, so
that the run starts from torch's weights, hands its parameters back under torch's names, and
plans its buckets over torch's names and layouts in the order torch's autograd makes the
gradients ready: the plan torch's DDP rebuilds after its first iteration, fingerprint and all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import hybrid.jax as hj
from hybrid.jax._specs import _leaves
from hybrid.models import GPT_MAPPING, FlaxGPT, GPTConfig, flax_loss
from hybrid.demo._jax_model import JaxModel, bucket_caps, host
from hybrid.demo._model import TrainConfig


def gpt_model(config: TrainConfig, params: dict[str, np.ndarray]) -> JaxModel:
    """The flax GPT of ``config.gpt``, paired with the torch GPT whose parameters (names in
    registration order, shapes) ``params`` holds.

    >>> from hybrid.demo import initial_params
    >>> config = TrainConfig(gpt=GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8), seq_len=4)
    >>> params = initial_params(config)
    >>> model = gpt_model(config, params)
    >>> ready = model.layout["ready_order"]  # the last module first; the tied embedding last (input and head)
    >>> ready[:2], ready[-1]
    (('ln_f.bias', 'ln_f.scale'), 'wte.embedding')
    >>> back = model.named(model.tree(params))
    >>> list(back) == list(params) and all(np.array_equal(back[n], params[n]) for n in params)
    True
    """
    shapes = tuple((n, tuple(a.shape)) for n, a in params.items())
    return _gpt_model(config.gpt, config.seq_len, shapes, tuple(bucket_caps(config).items()))


@functools.lru_cache(maxsize=4)
def _gpt_model(gpt: GPTConfig, seq_len: int, torch_shapes: tuple, caps: tuple) -> JaxModel:
    # cached: tracing the backward for its ready order takes a second or two, and a demo builds
    # the same model for several runs
    flax_model = FlaxGPT(gpt)
    like = jax.eval_shape(flax_model.init, jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
    names, leaves, treedef = _leaves(like)
    pairing = GPT_MAPPING.pair(dict(zip(names, (tuple(x.shape) for x in leaves))), dict(torch_shapes))

    def loss(params, idx, targets):
        return flax_loss(flax_model, params, idx, targets)

    def tree(params: dict[str, np.ndarray]):
        arrays = pairing.to_jax(params)
        return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(arrays[n], x.dtype) for n, x in zip(names, leaves)])

    def named(tree) -> dict[str, np.ndarray]:
        tree_names, tree_leaves, _ = _leaves(tree)
        return pairing.to_torch({n: host(x) for n, x in zip(tree_names, tree_leaves)})

    tokens = jax.ShapeDtypeStruct((2, seq_len), jnp.int32)
    ready = tuple(hj.gradient_ready_order(loss, like, tokens, tokens))
    return JaxModel(tree, named, loss, dict(order=None, ready_order=ready, pairing=pairing, **dict(caps)))
