"""The GPT pair's numpy half: a synthetic token stream, and the weights both frameworks start from.

The stream is a fixed random "grammar": every token has four possible successors, drawn with
probabilities 0.6 / 0.25 / 0.1 / 0.05. A model that has learnt it predicts the next token at
about 1.0 nat of cross-entropy, against ln(vocab) for a uniform guess, so the loss falls visibly
within tens of steps. It is deterministic in ``(seed, step)``: any step's batch, a resumed run's
too, is the one the uninterrupted run saw.
"""

from __future__ import annotations

import functools

import numpy as np

from hybrid.models._config import GPTConfig

_SUCCESSOR_PROBS = (0.6, 0.25, 0.1, 0.05)


@functools.lru_cache(maxsize=8)
def _successors(seed: int, vocab_size: int) -> np.ndarray:
    """``(vocab_size, 4)``: the tokens that may follow each token, most likely first."""
    rng = np.random.default_rng([seed, 3])
    return np.stack([rng.choice(vocab_size, size=len(_SUCCESSOR_PROBS), replace=False) for _ in range(vocab_size)])


def token_batch(seed: int, step: int, vocab_size: int, rows: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s batch: ``(idx, targets)``, int64 ``(rows, seq_len)``, each row a stretch of
    the stream and ``targets`` the token after each of ``idx``'s.

    >>> idx, targets = token_batch(0, 5, 16, 3, 8)
    >>> idx.shape, idx.dtype, bool((idx[:, 1:] == targets[:, :-1]).all())
    ((3, 8), dtype('int64'), True)
    >>> bool((token_batch(0, 5, 16, 3, 8)[0] == idx).all())  # the same batch every time
    True
    """
    table = _successors(seed, vocab_size)
    rng = np.random.default_rng([seed, 4, step])
    tokens = np.empty((rows, seq_len + 1), np.int64)
    tokens[:, 0] = rng.integers(0, vocab_size, size=rows)
    which = rng.choice(len(_SUCCESSOR_PROBS), p=_SUCCESSOR_PROBS, size=(rows, seq_len))
    for t in range(seq_len):
        tokens[:, t + 1] = table[tokens[:, t], which[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def gpt_init(seed: int, config: GPTConfig) -> dict[str, np.ndarray]:
    """The torch GPT's initial weights (GPT-2's init from torch's generator seeded with ``seed``)
    as numpy by torch's names, in registration order: what both frameworks start from (the JAX
    side through the mapping). Imports torch.

    >>> p = gpt_init(0, GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    >>> list(p)[:3], p["wte.weight"].shape
    (['wte.weight', 'wpe.weight', 'h.0.ln_1.weight'], (16, 8))
    """
    import torch

    from hybrid.models import TorchGPT

    with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
        torch.manual_seed(seed)
        model = TorchGPT(config)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
