"""A Llama-style decoder written the way torchtitan writes it: the model FSDP2 users bring.

RMSNorm, rotary position embeddings held as a persistent complex64 ``freqs_cis`` buffer, SwiGLU
feed-forward, an untied output head, blocks in an ``nn.ModuleDict`` keyed by layer index, and a
root ``init_weights(buffer_device=None)`` that initialises the whole model in one call, with
torchtitan's depth-scaled std (``0.02 / sqrt(2 * (layer_id + 1))``). Users build it on the meta
device, shard it, then call ``init_weights`` once on the root; the blocks' own ``init_weights``
take the std their parent computed, so they are not a per-module ``init_fn``.

No dropout, no KV cache, no grouped-query attention: what matters here is the shape of the code
(buffers of other dtypes, a whole-model initialiser, an untied head), not the architecture.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Hyperparameters of :class:`Llama` (torchtitan's ``TransformerModelArgs``, trimmed).

    The default is about 0.25M parameters, small enough for CPU tests of several ranks.

    >>> LlamaConfig().num_params()
    246336
    >>> LlamaConfig(dim=30, n_heads=4)
    Traceback (most recent call last):
    ...
    ValueError: dim=30 must be a multiple of 2 * n_heads=8 (rotary pairs per head)
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    hidden_dim: int = 192
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.dim % (2 * self.n_heads):
            raise ValueError(f"dim={self.dim} must be a multiple of 2 * n_heads={2 * self.n_heads} "
                             "(rotary pairs per head)")

    def num_params(self) -> int:
        per_layer = 4 * self.dim * self.dim + 3 * self.dim * self.hidden_dim + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * per_layer + self.dim


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """``end x dim / 2`` complex64 rotations ``exp(i * t * theta^(-2k / dim))`` (torchtitan's)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """Rotate query and key pairs by ``freqs_cis[:seqlen]`` in complex arithmetic (torchtitan's)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, self.n_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, config: LlamaConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # torchtitan's depth_init

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder; ``forward(tokens) -> logits`` (float32), as torchtitan's ``Transformer``.

    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> model = Llama(LlamaConfig())
    >>> model.freqs_cis.dtype, model(torch.zeros(2, 8, dtype=torch.long)).shape
    (torch.complex64, torch.Size([2, 8, 256]))
    >>> with torch.device("meta"):
    ...     meta = Llama(LlamaConfig())
    >>> _ = meta.to_empty(device="cpu"); meta.init_weights()
    >>> bool(torch.equal(meta.freqs_cis, model.freqs_cis))
    True
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=True)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, config) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.init_weights()

    def _precompute_freqs_cis(self) -> torch.Tensor:
        c = self.config
        return precompute_freqs_cis(c.dim // c.n_heads, c.max_seq_len * 2, c.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None):
        """The whole model's initialisation, torchtitan's: called once on the root after
        ``to_empty`` (a meta build), or by ``__init__``. ``buffer_device`` places ``freqs_cis``."""
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        final_out_std = self.config.dim ** -0.5
        cutoff = 3
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std,
                              a=-cutoff * final_out_std, b=cutoff * final_out_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h)).float()
