"""The GPT-2-style decoder's hyperparameters and its torch/flax mapping: numpy only, shared by both halves."""

from __future__ import annotations

import dataclasses

from hybrid.core import ParamMapping


# The names GPTConfig.named knows, for command lines' choices.
CONFIG_NAMES = ("gpt2-small", "tiny")


@dataclasses.dataclass(frozen=True, slots=True)
class GPTConfig:
    """Hyperparameters of the GPT-2-style decoder, the same for the torch and the flax model.

    The default is about 0.94M parameters, small enough for CPU tests; :meth:`gpt2` is GPT-2
    small (124M). Names follow GPT-2's and nanoGPT's configs.

    Args:
      vocab_size: tokens; the LM head is tied to the token embedding (one ``vocab_size x n_embd`` matrix).
      block_size: the longest sequence (rows of the position embedding).
      n_layer, n_head, n_embd: blocks, attention heads, model width (``n_embd % n_head == 0``).
      layer_norm_eps: GPT-2's 1e-5, on both sides (flax's ``LayerNorm`` defaults to 1e-6).
      init_std: the normal init of every weight and embedding; residual projections (``c_proj``)
        get ``init_std / sqrt(2 * n_layer)``, as GPT-2.

    >>> GPTConfig().num_params()
    940800
    >>> GPTConfig(n_embd=100, n_head=3)
    Traceback (most recent call last):
    ...
    ValueError: n_embd=100 must be a multiple of n_head=3
    """

    vocab_size: int = 1024
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        for f in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if not self.layer_norm_eps > 0 or not self.init_std > 0:
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps!r} and init_std={self.init_std!r} must be positive")

    @classmethod
    def gpt2(cls) -> "GPTConfig":
        """GPT-2 small: 50257 tokens, 1024 positions, 12 layers of 12 heads, width 768 (124M parameters).

        >>> GPTConfig.gpt2().num_params()
        124439808
        """
        return cls(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)

    @classmethod
    def named(cls, name: str) -> "GPTConfig":
        """A config by name, as command lines give it: ``"gpt2-small"`` (:meth:`gpt2`, 124M) or
        ``"tiny"`` (the default config, 0.94M, for CPU runs).

        >>> GPTConfig.named("gpt2-small") == GPTConfig.gpt2()
        True
        >>> GPTConfig.named("gpt2-medium")
        Traceback (most recent call last):
        ...
        ValueError: unknown GPT config 'gpt2-medium'; known: gpt2-small, tiny
        """
        if name == "gpt2-small":
            return cls.gpt2()
        if name == "tiny":
            return cls()
        raise ValueError(f"unknown GPT config {name!r}; known: {', '.join(CONFIG_NAMES)}")

    def num_params(self) -> int:
        """Trainable parameters, the tied embedding counted once (torch's ``named_parameters()``)."""
        d = self.n_embd
        block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return self.vocab_size * d + self.block_size * d + self.n_layer * block + 2 * d


# torch names: wte.weight, wpe.weight, h.0.ln_1.weight, h.0.attn.c_attn.weight, ..., ln_f.weight, and
# lm_head.weight, the token embedding itself; flax names: wte.embedding, h_0.ln_1.scale, ... The
# built-in flax rules place every tensor. What the model declares: the tie, and that ln_1 / ln_2 are
# names (not linen's items 1 and 2 of a list "ln"), so torch's names follow from flax's alone.
GPT_MAPPING = ParamMapping.flax(tied={"lm_head.weight": "wte.weight"}, renames={"ln_1": "ln_1", "ln_2": "ln_2"})
