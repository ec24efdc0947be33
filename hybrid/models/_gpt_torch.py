"""The GPT-2-style decoder as torch users write it: ``nn.Embedding``, ``nn.LayerNorm``, ``nn.Linear``.

Pre-LayerNorm blocks (``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``), causal self-attention with
the three projections in one ``c_attn`` Linear (GPT-2's, nanoGPT's), a tanh-GELU MLP of width
``4 * n_embd``, a final LayerNorm and an LM head tied to the token embedding. No dropout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.models._config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The torch half of the model pair; ``forward(idx, targets=None) -> (logits, loss)``.

    Args:
      config: the hyperparameters (default :class:`GPTConfig`, ~0.94M parameters).

    >>> torch.manual_seed(0) and None
    >>> model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    >>> logits, loss = model(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long))
    >>> tuple(logits.shape), loss.shape, model.lm_head.weight is model.wte.weight
    ((2, 5, 16), torch.Size([]), True)
    >>> sum(p.numel() for p in model.parameters()) == model.config.num_params()
    True
    """

    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: named_parameters() lists it once, as wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of the residual projections
                nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def init_weights(self, module: nn.Module | None = None) -> None:
        """GPT-2's initialisation, one module's own tensors at a time: what a build on the meta
        device needs (``ZeRO3(meta_model, init_fn=meta_model.init_weights)``, as FSDP's
        ``param_init_fn``), since ``__init__``'s initialisation never ran there. Without a module,
        every module in ``modules()`` order (torchtitan's whole-model ``init_weights()``).

        Normal(0, ``init_std``) for Linear and Embedding weights, ``init_std / sqrt(2 n_layer)``
        for the residual projections (``c_proj``), zero biases, LayerNorm's ones and zeros. The
        distribution of ``__init__``'s; not its values under one seed (there the constructors draw
        first, and the residual projections are drawn again after every other module).

        >>> torch.manual_seed(0) and None
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=64))
        >>> model.to_empty(device="cpu").init_weights()
        >>> mlp = model.h[0].mlp  # the residual projection at 1 / sqrt(2 n_layer) of the other's std
        >>> round(float(mlp.c_proj.weight.detach().std() / mlp.c_fc.weight.detach().std()), 2)
        0.5
        """
        if module is None:
            for m in self.modules():
                self.init_weights(m)
            return
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = any(module is block.attn.c_proj or module is block.mlp.c_proj for block in self.h)
            std = self.config.init_std / math.sqrt(2 * self.config.n_layer) if residual else self.config.init_std
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"a sequence of {T} tokens is longer than block_size={self.config.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss
