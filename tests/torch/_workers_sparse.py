"""Worker processes for tests/torch/test_ddp_sparse.py: models with nn.Embedding / nn.EmbeddingBag
(sparse=True) under torch's DDP and ours, one after the other in the same gloo processes, results
saved per rank. Gradients are saved as they are (sparse COO tensors stay sparse)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from _workers import _init, side_by_side

ROWS = 40


class Tables(nn.Module):
    """Two sparse tables (Embedding, EmbeddingBag), a dense Embedding and Linear layers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, 6, sparse=True)
        self.bag = nn.EmbeddingBag(ROWS, 5, mode="sum", sparse=True)
        self.dense_emb = nn.Embedding(ROWS, 3)
        self.a = nn.Linear(14, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, use_emb=True):
        e = self.emb(x).mean(1) if use_emb else torch.zeros(len(x), 6)
        h = torch.cat([e, self.bag(x), self.dense_emb(x).sum(1)], 1)
        return self.b(torch.relu(self.a(h)))


class Tied(nn.Module):
    """A sparse Embedding whose weight is also used as a dense matrix: a dense gradient arrives."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, 6, sparse=True)
        self.out = nn.Linear(6, 4)

    def forward(self, x):
        return self.out(self.emb(x).mean(1)) + self.emb.weight.sum()


class Lookup(nn.Module):
    """A plain Parameter read with F.embedding(sparse=True): a sparse gradient DDP does not expect.
    ``rows * 6`` elements at or above 65536 takes the path that scales while copying in the hook."""

    def __init__(self, rows=ROWS):
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, 6))
        self.out = nn.Linear(6, 4)

    def forward(self, x):
        return self.out(nn.functional.embedding(x, self.table, sparse=True).mean(1))


def _model(factory, rank):
    torch.manual_seed(0)
    model = factory()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank * 0.01)  # different per rank: DDP's initial broadcast must fix it
    return model


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    # Few rows per rank, overlapping across ranks: the sparse all-reduce merges index sets.
    return torch.randint(0, ROWS // 2, (4, 5), generator=g) + rank, torch.randn(4, 4, generator=g)


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _step(ddp, opt, rank, step, **kw):
    x, y = _data(rank, step)
    ((ddp(x, **kw) - y) ** 2).mean().backward()
    grads = _grads(ddp.module)
    opt.step()
    opt.zero_grad()
    return grads


def _result(ddp, grads, **extra):
    return {"params": [p.detach().clone() for p in ddp.module.parameters()], "grads": grads, **extra}


def _recording(log, inner=default_hooks.allreduce_hook):
    def hook(state, bucket):
        buf = bucket.buffer()
        log.append((bucket.index(), [id(p) for p in bucket.parameters()], str(buf.layout),
                    len(bucket.gradients()), bucket.is_last()))
        return inner(state, bucket)
    return hook


def train(cls, rank, world, kwargs, hook=None, steps=4):
    """SGD steps on Tables; ``hook``: None, "record" (allreduce_hook, bucket layout logged) or a
    built-in hook type name."""
    ddp = cls(_model(Tables, rank), **kwargs)
    log = []
    if hook == "record":
        ddp.register_comm_hook(None, _recording(log))
    elif hook is not None:
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    grads = [_step(ddp, opt, rank, step) for step in range(steps)]
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    buckets = [(b, [index[i] for i in ids], layout, n, last) for b, ids, layout, n, last in log]
    return _result(ddp, grads, buckets=buckets)


def no_sync(cls, rank, world, kwargs):
    """Sparse gradients accumulated over two no_sync() micro-batches, then a synchronizing one."""
    ddp = cls(_model(Tables, rank), **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        with ddp.no_sync():
            for micro in range(2):
                x, y = _data(rank, 10 * step + micro)
                ((ddp(x) - y) ** 2).mean().backward()
        grads.append(_step(ddp, opt, rank, 10 * step + 5))
    return _result(ddp, grads)


def joined(cls, rank, world):
    """Uneven inputs under ddp.join(): rank r runs 2 + r steps; joined ranks shadow the sparse
    all-reduce of the others with empty sparse tensors."""
    ddp = cls(_model(Tables, rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    with ddp.join():
        for step in range(2 + rank):
            grads.append(_step(ddp, opt, rank, step))
    return _result(ddp, grads)


def unused_table(cls, rank, world, kwargs, first=1):
    """The sparse table unused from step ``first`` on (torch cannot reduce an undefined sparse grad)."""
    ddp = cls(_model(Tables, rank), **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        _step(ddp, opt, rank, step, use_emb=step < first)


def misuse(cls, rank, world, factory):
    ddp = cls(_model(factory, rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _step(ddp, opt, rank, 0)


def _dense_rows_hook(state, bucket):
    """With sparse metadata covering every row: all-reduce the sparse bucket as dense rows (the
    values torch's reducer then places at the global ids); dense buckets as allreduce_hook."""
    buf = bucket.buffer()
    if not buf.is_sparse:
        return default_hooks.allreduce_hook(state, bucket)
    dense = buf.to_dense().div_(dist.get_world_size())
    return dist.all_reduce(dense, async_op=True).get_future().then(lambda fut: fut.value()[0])


def metadata(cls, rank, world, ids, hooked, every_step=True):
    """``_set_sparse_metadata(ids)`` before each step (torch's reducer uses it for one reduction)
    or only before the first."""
    ddp = cls(_model(Tables, rank))
    if hooked:
        ddp.register_comm_hook(None, _dense_rows_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        if every_step or step == 0:
            ddp._set_sparse_metadata(ids)
        grads.append(_step(ddp, opt, rank, step))
    return _result(ddp, grads)


def logging_data(cls, rank, world):
    ddp = cls(_model(Tables, rank), bucket_cap_mb=0.0005)
    before = ddp._get_ddp_logging_data()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _step(ddp, opt, rank, 0)
    return {"before": before, "after": ddp._get_ddp_logging_data()}


ALL_ROWS = {"emb.weight": torch.arange(ROWS), "bag.weight": torch.arange(ROWS)}
CASES = {
    "plain": (train, ({},)),
    "find_unused": (train, ({"find_unused_parameters": True},)),
    "view": (train, ({"gradient_as_bucket_view": True},)),
    "view_find_unused": (train, ({"gradient_as_bucket_view": True, "find_unused_parameters": True},)),
    "static": (train, ({"static_graph": True},)),
    "small_caps": (train, ({"bucket_cap_mb": 0.0005},)),
    "hook": (train, ({"bucket_cap_mb": 0.0005}, "record")),
    "hook_view_static": (train, ({"gradient_as_bucket_view": True, "static_graph": True}, "record")),
    "builtin_ALLREDUCE": (train, ({}, "ALLREDUCE")),
    "no_sync": (no_sync, ({},)),
    "no_sync_find_unused": (no_sync, ({"find_unused_parameters": True},)),
    "join": (joined, ()),
    "unused_find_unused": (unused_table, ({"find_unused_parameters": True},)),
    "unused_static": (unused_table, ({"static_graph": True},)),
    "unused_static_first": (unused_table, ({"static_graph": True}, 0)),
    "dense_into_sparse": (misuse, (Tied,)),
    "sparse_into_dense": (misuse, (Lookup,)),
    "sparse_into_dense_fused": (misuse, (lambda: Lookup(rows=11000),)),
    "metadata_hook": (metadata, (ALL_ROWS, True)),
    "metadata_once": (metadata, (ALL_ROWS, True, False)),
    "metadata_default_hook": (metadata, (ALL_ROWS, False)),
    "metadata_partial": (metadata, ({"emb.weight": torch.arange(10), "bag.weight": torch.arange(10)}, True)),
    "metadata_missing": (metadata, ({"emb.weight": torch.arange(ROWS)}, True)),
    "metadata_not_a_dict": (metadata, ([1, 2], True)),
    "logging": (logging_data, ()),
}


def error_log(cls, rank, world, case):
    """Case ``case``, which raises, with ``cls`` recording the DDP it builds: the error and that
    DDP's logging data after it."""
    made = []

    class Recorded(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    fn, args = CASES[case]
    try:
        fn(Recorded, rank, world, *args)
    except Exception as e:  # noqa: BLE001 - compared with torch's by the test
        return {"error": str(e), "log": made[-1]._get_ddp_logging_data()}
    raise AssertionError(f"{case} raised nothing")


ERROR_LOGS = {f"log_{case}": (error_log, (case,)) for case in (
    "unused_find_unused", "unused_static_first", "dense_into_sparse", "sparse_into_dense", "metadata_once",
    "metadata_default_hook", "metadata_partial", "metadata_missing", "metadata_not_a_dict", "unused_static")}
CASES.update(ERROR_LOGS)


def sparse_worker(rank, world, port, outdir, case_names):
    _init(rank, world, port, timeout_s=int(os.environ.get("HYBRID_TEST_PG_TIMEOUT", "30")))
    results = {name: side_by_side(CASES[name][0], rank, world, *CASES[name][1]) for name in case_names}
    torch.save(results, os.path.join(outdir, f"sparse_rank{rank}.pt"))
    dist.destroy_process_group()
