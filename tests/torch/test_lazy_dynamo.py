"""``import hybrid.torch`` leaves ``torch._dynamo`` (about 1 s of CPU) unimported, and once anything
imports it hybrid's code carries dynamo's real decorators, as if they had been applied at import.

One fresh interpreter, with a gloo world of its own (of one rank): what an import pulls in, and
models built before dynamo exists, can only be seen in a process that has never imported dynamo
(the shared worlds' ranks have). It checks the modules an import leaves, registers hooks and builds
a ZeRO3 model and a DDP before dynamo exists, imports dynamo, checks the decorators against what
``torch._dynamo.disable`` / ``skip`` give, then compiles the models built before and the same
built after: dynamo's frame and graph counters and the losses must be equal (a hook left
undecorated is traced instead: 33 frames and 6 graphs where 3 and 3 are expected). The counts
tests/torch_compile pins for each kind of compile hold for models built after the import.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import copy, os, sys, tempfile
    import torch
    import torch.distributed as dist
    from torch import nn
    import hybrid.torch, hybrid.demo._rank, hybrid.checkpoint.torch
    import hybrid.torch as ht
    from hybrid.torch import _lazy_dynamo
    late = [m for m in sys.modules if m == "torch._dynamo" or m.startswith(("torch._dynamo.", "torch._inductor"))]
    assert not late, late
    # nor torch.distributed.optim (FSDP, DTensor and sympy behind it): ZeroRedundancyOptimizer imports it when built
    assert "torch.distributed.optim" not in sys.modules and "torch.distributed.fsdp" not in sys.modules

    torch.set_num_threads(1)
    store = tempfile.TemporaryDirectory()
    dist.init_process_group("gloo", init_method="file://" + os.path.join(store.name, "store"), rank=0, world_size=1)

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        return {"zero3_whole": ht.ZeRO3(copy.deepcopy(m)), "zero3_parts": ht.ZeRO3(copy.deepcopy(m)),
                "ddp": ht.DistributedDataParallel(copy.deepcopy(m))}

    early = make()

    from hybrid.torch.ddp._ddp import DistributedDataParallel
    from hybrid.torch.dynamo import _compile
    from hybrid.torch.zero.zero3 import _model
    raw = DistributedDataParallel._pre_forward
    assert not hasattr(raw, "_torchdynamo_disable")
    calls = []
    lin = torch.nn.Linear(2, 2)
    first = lin.register_forward_pre_hook(lambda m, a: calls.append("first"))
    pending = _lazy_dynamo.register_disabled_hook(lin.register_forward_pre_hook, lambda m, a: calls.append("late"))
    removed = _lazy_dynamo.register_disabled_hook(lin.register_forward_hook, lambda m, a, o: calls.append("gone"))
    removed.remove()
    assert not _lazy_dynamo.is_compiled_module(lin)

    import torch._dynamo
    from torch._dynamo.eval_frame import OptimizedModule, innermost_fn
    assert _lazy_dynamo._watcher not in sys.meta_path

    def is_disabled(fn):  # torch._dynamo.disable's wrapper: its frame is dynamo's, skipped
        return fn._torchdynamo_disable_recursive and fn.__code__ is torch._dynamo.disable(len).__code__

    for fn in (DistributedDataParallel._pre_forward, DistributedDataParallel._post_forward,
               _model.ZeRO3._begin_forward_eagerly, _model.ZeRO3._end_forward, _compile._entry):
        assert is_disabled(fn), fn
    assert innermost_fn(DistributedDataParallel._pre_forward) is raw
    assert _model._begin_forward is _model._begin_forward_seen and _model._begin_forward._torchdynamo_disable
    assert _compile.forward_module._torchdynamo_disable
    hooks = list(lin._forward_pre_hooks.items())
    assert [k for k, _ in hooks] == [first.id, pending.id], hooks
    assert not hasattr(hooks[0][1], "_torchdynamo_disable") and is_disabled(hooks[1][1])
    assert not lin._forward_hooks
    lin(torch.ones(2))
    assert calls == ["first", "late"], calls

    # dynamo imported: applied on the spot, as torch._dynamo.disable would be
    now = _lazy_dynamo.register_disabled_hook(lin.register_forward_hook, lambda m, a, o: calls.append("now"))
    assert is_disabled(lin._forward_hooks[now.id])
    assert _lazy_dynamo.is_compiled_module(torch.compile(lin, backend="eager"))

    from torch._dynamo.utils import counters
    built_late = make()

    def compiled_run(name, model):
        torch._dynamo.reset()
        counters.clear()
        if name == "zero3_parts":  # its units (the Linears) compiled: their hooks run inside
            for lin in model.module[::2]:
                lin.compile(backend="eager")
            call = model
        else:
            call = torch.compile(model, backend="eager")
        losses = []
        for step in range(3):
            loss = call(torch.full((4, 8), step + 1.0)).square().sum()
            loss.backward()
            losses.append(loss.item())
        return dict(counters["frames"]), dict(counters["stats"]), losses

    for name in early:
        before, after = compiled_run(name, early[name]), compiled_run(name, built_late[name])
        assert before == after and after[1]["unique_graphs"] > 0, (name, before, after)
    dist.destroy_process_group()
    print("ok")
""")


def test_import_leaves_dynamo_out_and_models_built_before_compile_as_after():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
