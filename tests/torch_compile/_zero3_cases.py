"""Cases run on every rank of a gloo world: ``torch.compile`` of a ZeRO3 model against the same
model under eager ZeRO3, both trained in lockstep from one build on rank-dependent tokens.

The model is :class:`hybrid.models.Llama` (torchtitan's way: RMSNorm, a complex64 ``freqs_cis``
buffer, SwiGLU, blocks in a ``ModuleDict``), tiny so that compiling stays in seconds. Two ways
in, as users compile: the whole wrapped model (``torch.compile(ZeRO3(model))``) and each block
before wrapping (``block.compile()``, torchtitan's).

Tolerances: ``aot_eager`` runs the very ops eager runs, on the same gathered values, in the same
collectives: parameters and losses equal bit for bit (asserted). inductor fuses and reorders
float32 arithmetic: ``rtol 1.3e-6, atol 1e-6`` (torch's float32 ``assert_close`` defaults).
Measured at 2 ranks after the four AdamW steps: parameters 6.1e-7 apart whole, 1.7e-7 per block
(Adam divides by the root of the second moment, so a gradient's last bits move a parameter by more
than its own rounding), losses 4.8e-7.

After ``WARM_UP`` steps (the first compiles; the second meets ``.grad`` and optimizer state made)
the remaining steps run under ``torch._dynamo.config.error_on_recompile``, and dynamo's frame and
graph counters must not move: no recompile after warm-up.
"""

from __future__ import annotations

import copy
import functools
import shutil
import tempfile

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from hybrid.models import Llama, LlamaConfig
from hybrid.torch import ZeRO3, ZeRO3Optimizer

CONFIG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_seq_len=8)
NUM_STEPS, WARM_UP = 4, 2
RTOL, ATOL = 1.3e-6, 1e-6


def tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len), generator=g)


class Run:
    """One ZeRO3 model and its optimizer; ``compile`` is None (eager), "whole" (the ZeRO3 model
    compiled), "blocks" or "root" (compiled before wrapping)."""

    def __init__(self, base: Llama, *, compile: str | None, backend: str, optim, zero3: dict, opt: dict,
                 fullgraph: bool = False):
        model = copy.deepcopy(base)
        if compile == "blocks":
            for block in model.layers.values():
                block.compile(backend=backend, fullgraph=fullgraph)
        elif compile == "root":  # the whole model compiled before wrapping: one unit, one graph
            model.compile(backend=backend, fullgraph=fullgraph)
        self.zero = ZeRO3(model, **zero3)
        self.call = torch.compile(self.zero, backend=backend) if compile == "whole" else self.zero
        # the compiled model, as a user passes it (ZeRO3Optimizer takes what it runs)
        self.opt = ZeRO3Optimizer(self.call, optim, **opt)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.call(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        loss.backward()
        if not self.opt.step_in_backward:
            self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def _compare(rank: int, world_size: int, *, compile: str, backend: str = "aot_eager", optim=torch.optim.AdamW,
             zero3: dict | None = None, opt: dict | None = None, offload: bool = False,
             eager_calls: bool = False, fullgraph: bool = False) -> None:
    """``eager_calls``: after warm-up the compiled run's ZeRO3 is also called eagerly (an evaluation
    without gradients) before each step, which must not make dynamo compile again."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Llama(CONFIG)
    zero3, opt = dict(zero3 or {}), {"lr": 1e-2, **(opt or {})}
    with tempfile.TemporaryDirectory() as tmp:
        opt_of = (lambda: {**opt, "offload_dir": tmp}) if offload else (lambda: opt)
        eager = Run(base, compile=None, backend=backend, optim=optim, zero3=zero3, opt=opt_of())
        compiled = Run(base, compile=compile, backend=backend, optim=optim, zero3=zero3, opt=opt_of(),
                       fullgraph=fullgraph)
        exact = backend == "aot_eager"
        seen = None
        for step in range(NUM_STEPS):
            x = tokens(rank, step)
            if eager_calls and step >= WARM_UP:
                with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
                    assert torch.equal(compiled.zero(x), eager.zero(x)), f"step {step}: an eager call differs"
            want = eager.step(x)
            if step < WARM_UP:
                got = compiled.step(x)
                seen = (counters["frames"]["total"], counters["stats"]["unique_graphs"])
            else:
                with torch._dynamo.config.patch(error_on_recompile=True):
                    got = compiled.step(x)
                now = (counters["frames"]["total"], counters["stats"]["unique_graphs"])
                assert now == seen, f"step {step}: dynamo compiled again after warm-up: {seen} -> {now}"
            assert seen[1] > 0, "nothing was compiled"
            _check(eager.zero, compiled.zero, want, got, exact, f"step {step}")


def _check(eager: ZeRO3, compiled: ZeRO3, want, got, exact: bool, what: str) -> None:
    ours, ref = compiled.state_dict(), eager.state_dict()
    for name, q in ref.items():
        p = ours[name]
        if exact:
            assert torch.equal(p, q), f"{what}: {name} differs by {(p - q).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=f"{what}: {name}")
    if exact:
        assert torch.equal(got, want), f"{what}: loss {got.item()} != {want.item()}"
    else:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _resume(rank: int, world_size: int) -> None:
    """A model compiled whole saves with ``hybrid.checkpoint.torch.save`` (given the compiled model,
    as a user holds it), loads into a fresh compiled model built from other weights, and trains on
    as the uninterrupted eager run does, bit for bit (aot_eager)."""
    import torch.distributed as dist

    from hybrid.checkpoint.torch import load, save

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Llama(CONFIG)
    where = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)  # one directory for every rank's files
    path = f"{where[0]}/ckpt"
    eager = Run(base, compile=None, backend="aot_eager", optim=torch.optim.AdamW, zero3={}, opt={"lr": 1e-2})
    compiled = Run(base, compile="whole", backend="aot_eager", optim=torch.optim.AdamW, zero3={}, opt={"lr": 1e-2})
    for step in range(2):
        eager.step(tokens(rank, step))
        compiled.step(tokens(rank, step))
    save(path, compiled.call, compiled.opt, step=2)
    torch.manual_seed(1)
    resumed = Run(Llama(CONFIG), compile="whole", backend="aot_eager", optim=torch.optim.AdamW, zero3={},
                  opt={"lr": 1e-2})
    assert load(path, resumed.call, resumed.opt) == 2
    for step in range(2, NUM_STEPS):
        x = tokens(rank, step)
        want, got = eager.step(x), resumed.step(x)
        _check(eager.zero, resumed.zero, want, got, True, f"resumed, step {step}")
    dist.barrier()  # every rank has read its file
    if rank == 0:
        shutil.rmtree(where[0])


def _mixed() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


CASES = {
    "whole": functools.partial(_compare, compile="whole"),
    "blocks": functools.partial(_compare, compile="blocks"),
    "whole_memory": functools.partial(_compare, compile="whole", zero3={"policy": "memory"}, eager_calls=True),
    "blocks_memory": functools.partial(_compare, compile="blocks", zero3={"policy": "memory"}),
    # fullgraph=True per block: the hooks ZeRO3 puts on a compiled block break no graph of it
    "blocks_fullgraph": functools.partial(_compare, compile="blocks", fullgraph=True),
    "root_memory_fullgraph": functools.partial(_compare, compile="root", zero3={"policy": "memory"}, fullgraph=True),
    "whole_buckets_sgd": functools.partial(_compare, compile="whole", optim=torch.optim.SGD,
                                           zero3={"bucket_cap_mb": 0.005}, opt={"lr": 0.1, "momentum": 0.9}),
    "whole_mixed": functools.partial(_compare, compile="whole", zero3=_mixed()),
    "blocks_mixed_memory": functools.partial(_compare, compile="blocks", zero3={"policy": "memory", **_mixed()}),
    "whole_step_in_backward": functools.partial(_compare, compile="whole", opt={"step_in_backward": True}),
    "blocks_offload": functools.partial(_compare, compile="blocks", offload=True),
    "whole_offload_step_in_backward_memory": functools.partial(
        _compare, compile="whole", zero3={"policy": "memory"}, opt={"step_in_backward": True}, offload=True),
}

CASES["whole_checkpoint"] = _resume

# inductor: the backend whose size and stride asserts the freed parameters broke (issue 44).
CASES.update({
    "inductor_whole": functools.partial(_compare, compile="whole", backend="inductor"),
    "inductor_blocks_memory": functools.partial(_compare, compile="blocks", backend="inductor",
                                                zero3={"policy": "memory"}),
})

# Which cases run at which world size: every one at 2 ranks; at 1 and 3 the two ways in with the
# options that change what a unit gathers and when it steps (inductor builds C++ per graph: once).
CORE = ("whole", "blocks_memory", "whole_mixed", "whole_offload_step_in_backward_memory")
WORLDS = {1: CORE, 2: tuple(sorted(CASES)), 3: CORE}
