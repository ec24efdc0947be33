"""The issue's failure at 2 gloo ranks: a model holding a complex64 buffer (``hybrid.models.Llama``'s
``freqs_cis``) saved by every rank, as hybrid's DDP + AdamW and as ZeRO3 + its optimizer, loads
back bit for bit (tolerance zero: copies of the same bits); a dtype no checkpoint holds is refused
on every rank before anything is written, so no rank is left waiting on another's file.

Its own 2-rank world (one job, both frontends in it): the shared worlds of tests/checkpoint run
other files' jobs, and this is the one place that needs the save collective itself.
"""

from __future__ import annotations

from tests._procs import forkserver_ranks, init_gloo, report_outcome

CONFIG = dict(n_layers=1, dim=16, n_heads=2, hidden_dim=32, vocab_size=32, max_seq_len=8)


def _rank(root, rank, port, out):
    init_gloo(rank, port)

    def job():
        import os

        import torch

        from hybrid.checkpoint import CheckpointError
        from hybrid.checkpoint.torch import load, save
        from hybrid.models import Llama, LlamaConfig
        from hybrid.torch import ZeRO3, ZeRO3Optimizer, DistributedDataParallel

        tokens = torch.arange(8).reshape(2, 4) + rank

        def bits(t):
            return t.detach().reshape(-1).contiguous().view(torch.uint8)

        def same(a, b, what):
            for (n, x), (m, y) in zip(a.items(), b.items()):
                assert n == m and x.dtype == y.dtype and torch.equal(bits(x), bits(y)), f"{what}: {n}"

        # hybrid DDP + a plain AdamW
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Llama(LlamaConfig(**CONFIG)))
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.1)
        ddp(tokens).pow(2).mean().backward()
        opt.step()
        save(os.path.join(root, "ddp"), ddp, opt, step=1)
        torch.manual_seed(1)
        fresh = DistributedDataParallel(Llama(LlamaConfig(**CONFIG)))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        load(os.path.join(root, "ddp"), fresh, fresh_opt)
        same(ddp.module.state_dict(), fresh.module.state_dict(), "ddp")
        for p, q in zip(ddp.parameters(), fresh.parameters()):
            same(opt.state[p], fresh_opt.state[q], "adamw state")
        # ZeRO3 + its optimizer (each rank writes its slices)
        torch.manual_seed(0)
        z = ZeRO3(Llama(LlamaConfig(**CONFIG)))
        zopt = ZeRO3Optimizer(z, torch.optim.AdamW, lr=0.1)
        z(tokens).pow(2).mean().backward()
        zopt.step()
        save(os.path.join(root, "zero3"), z, zopt, step=1)
        torch.manual_seed(1)
        z2 = ZeRO3(Llama(LlamaConfig(**CONFIG)))
        z2opt = ZeRO3Optimizer(z2, torch.optim.AdamW, lr=0.1)
        load(os.path.join(root, "zero3"), z2, z2opt)
        same(z.state_dict(), z2.state_dict(), "zero3")
        assert z2.module.freqs_cis.dtype == torch.complex64
        # a dtype no checkpoint holds: refused on every rank, before anything is written
        bad = torch.nn.Linear(2, 2)
        bad.register_buffer("q", torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8))
        try:
            save(os.path.join(root, "bad"), bad, step=0)  # (DDP cannot broadcast a quantized buffer)
        except CheckpointError as e:
            assert "tensor 'q' is qint8" in str(e), e
        else:
            raise AssertionError("a qint8 buffer was saved")
        assert not [n for n in os.listdir(root) if "bad" in n], os.listdir(root)

    report_outcome(rank, out, job)


def test_a_complex_buffer_saves_and_loads_at_two_ranks(tmp_path):
    reports, _ = forkserver_ranks(_rank, (str(tmp_path),), 2, wait_s=150)
    assert {r: o for r, (o, _) in reports.items()} == {0: "returned", 1: "returned"}
