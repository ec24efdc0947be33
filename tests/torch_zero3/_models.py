"""Models written the way users write them, that read parameters outside their own module's forward:
the shapes of code ZeRO-3 must train as DDP does (issue 36)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RootScale(nn.Module):
    """The root module owns a parameter and uses it between two Linears."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 16)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.b = nn.Linear(16, 6)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * self.scale)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class TinyGPT(nn.Module):
    """A root-owned position table, blocks, and an output head tied to the token embedding and
    read in the parent's forward (``x @ self.emb.weight.T``), as GPT code often writes it."""

    def __init__(self, vocab: int = 11, block: int = 6, d: int = 6, n_layer: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, block, d) * 0.1)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[:, :idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.emb.weight.T


class Siblings(nn.Module):
    """A Linear whose weight a sibling module also reads (through a reference it holds), a
    functional op on another module's parameter in the parent, and a module called twice."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.mix = nn.Linear(6, 6)
        self.reader = _Reader(self.mix)
        self.out = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mix(h)) + self.reader(h)
        h = torch.tanh(self.mix(h))  # called twice
        return self.out(h) + F.linear(h, self.out.weight, self.out.bias).pow(2).mean()


class _Reader(nn.Module):
    """Reads another module's weight in its own forward (it holds the module, not its parameters:
    they stay registered once, in ``mix``)."""

    def __init__(self, other: nn.Linear):
        super().__init__()
        self.__dict__["other"] = other  # not a submodule: no second registration
        self.gate = nn.Parameter(torch.full((6,), 0.5))

    def forward(self, h):
        return torch.sigmoid(self.gate) * (h @ self.other.weight.T)


def tokens(rank: int, step: int, *, vocab: int = 11, batch: int = 4, length: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, vocab, (batch, length), generator=g)


class Mixed(nn.Module):
    """torch's own layers, each initialised by the ``reset_parameters()`` its constructor calls:
    an embedding, LayerNorm, BatchNorm (running statistics: buffers), convolution and Linears."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.ln = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, idx):
        h = self.ln(self.emb(idx))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2).mean(1)
        return self.out(torch.tanh(self.bn(self.fc(h))))


class CausalMixer(nn.Module):
    """A causal mask kept as a non-persistent buffer, computed in ``__init__`` (not saved, not set
    by any ``reset_parameters``): a meta build needs an ``init_fn`` that computes it."""

    def __init__(self, length: int = 6, d: int = 8):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(length, length)), persistent=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        weights = torch.softmax(self.mask.log()[: x.shape[1], : x.shape[1]], dim=-1)
        return self.proj(weights @ x)


def causal_init(m: nn.Module) -> None:
    """The ``init_fn`` for :class:`CausalMixer`: the mask as ``__init__`` computes it, torch's own init
    for the rest."""
    if isinstance(m, CausalMixer):
        m.mask.copy_(torch.tril(torch.ones_like(m.mask)))
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()
