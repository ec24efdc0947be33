"""Multi-process cases: hybrid's ZeRO3 + ZeRO3Optimizer against torch's DDP + the plain optimizer
(and, for mixed precision, against torch's FSDP2 with the same policy), compared after every step
from the first. Tolerances: see ``_pair``."""

from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch

from hybrid.torch import ZeRO3, ZeRO3Optimizer
from tests.torch_zero._cases import OPTIMIZERS, batch, make_model
from tests.torch_zero2._cases import perturb_state
from tests.torch_zero3._clip_cases import CLIP_CASES
from tests.torch_zero3._pair import ATOL, LAYOUTS, RTOL, Pair, use_flat_collectives

NUM_STEPS = 4


def train(pair: Pair, rank: int, world_size: int, steps, what: str = "") -> None:
    for step in steps:
        pair.backward(batch(rank, step))
        pair.step()
        pair.check(world_size, f"step {step} {what}")


def parity(rank: int, world_size: int, *, optim: str, layout: str, groups: bool = False, model=None) -> None:
    pair = Pair(optim, LAYOUTS[layout], groups=groups, model=model)
    for step in range(NUM_STEPS):
        pair.backward(batch(rank, step))
        pair.check_sharded(world_size, f"step {step}")
        pair.step()
        pair.check(world_size, f"step {step}")
        pair.check_state(f"step {step}")


class Reordered(torch.nn.Module):
    """Layers registered in one order, used in another: the forward order is learned, not assumed."""

    def __init__(self):
        super().__init__()
        self.last, self.middle, self.first = torch.nn.Linear(6, 4), torch.nn.Linear(7, 6), torch.nn.Linear(5, 7)

    def forward(self, x):
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


class Shared(torch.nn.Module):
    """A layer applied twice and a weight tied between two modules (each holds it)."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = torch.nn.Linear(5, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.out.weight = self.block.weight  # tied: "out" and "block" both hold it
        self.frozen = torch.nn.Linear(6, 4)
        self.frozen.requires_grad_(False)  # not sharded: stays whole on every rank

    def forward(self, x):
        h = torch.tanh(self.block(torch.tanh(self.block(torch.tanh(self.inp(x))))))
        return self.frozen(torch.tanh(self.out(h)))


def reordered_order(rank: int, world_size: int) -> None:
    pair = Pair("adam", LAYOUTS["four_buckets"], model=Reordered())
    # Registration order last, middle, first: the plan's reverse guesses the forward uses "last"
    # first; one forward shows it uses "first" first.
    first_bucket = {pair.zero.bucket_plan.locate(i)[0] for i, n in enumerate(pair.zero._names) if n.startswith("first")}
    pair.backward(batch(rank, 0))
    assert pair.zero.forward_order[0] in first_bucket, (pair.zero.forward_order, first_bucket)
    pair.step()
    pair.check(world_size, "step 0")
    train(pair, rank, world_size, range(1, 3))


def accumulate(rank: int, world_size: int, *, layout: str) -> None:
    """Two backward passes per step without zero_grad: the slices add up, as .grad does. Not bit
    for bit: DDP averages ``mean_1 + local_2`` in the second backward, hybrid adds ``mean_2`` to
    ``mean_1``, which rounds differently."""
    pair = Pair("adam", LAYOUTS[layout])
    for step in range(3):
        pair.backward(batch(rank, 2 * step))
        pair.backward(batch(rank, 2 * step + 1))
        pair.step()
        pair.check(world_size, f"step {step}", exact=False)


def no_sync(rank: int, world_size: int, *, layout: str) -> None:
    """Backward passes under no_sync() keep local gradients; the next one reduces the sum (DDP's)."""
    pair = Pair("adamw", LAYOUTS[layout])
    for step in range(3):
        with pair.zero.no_sync(), pair.ref_ddp.no_sync():
            pair.backward(batch(rank, 3 * step))
            pair.backward(batch(rank, 3 * step + 1))
        assert pair.opt.grad_numel() == 0, "no_sync reduced"
        pair.backward(batch(rank, 3 * step + 2))
        pair.step()
        pair.check(world_size, f"step {step}")


def clip_norm(rank: int, world_size: int, *, norm_type: float, layout: str) -> None:
    """clip_grad_norm_: the total norm of torch's on DDP's full gradients, the same parameters after.
    SGD with momentum (Adam would hide the scale); the norm rtol 1.3e-6: the same float32 terms,
    summed in another order."""
    pair = Pair("sgd_momentum", LAYOUTS[layout])
    for step in range(3):
        pair.backward(batch(rank, step))
        want = torch.nn.utils.clip_grad_norm_(pair.ref_model.parameters(), 0.02, norm_type)
        got = pair.opt.clip_grad_norm_(0.02, norm_type)
        assert want > 0.04, f"step {step}: norm {want} would not clip"
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0, msg=f"step {step}: total norm")
        pair.opt.step(); pair.ref_opt.step(); pair.opt.zero_grad(); pair.ref_opt.zero_grad()
        # One rounding of the scale factor apart: clipped steps are compared with a tolerance.
        ours = pair.zero.state_dict()
        for name, q in pair.ref_model.state_dict().items():
            torch.testing.assert_close(ours[f"module.{name}"], q, rtol=RTOL, atol=ATOL, msg=f"step {step}: {name}")


def clip_value_and_torch_refused(rank: int, world_size: int) -> None:
    """clip_grad_value_ is exact; torch's own clip function fails naming the parameter and the
    method to use, instead of clipping nothing."""
    pair = Pair("sgd_momentum", LAYOUTS["four_buckets"])
    pair.backward(batch(rank, 0))
    with pytest.raises(TypeError, match=r"parameter '0\.weight'.*opt\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(pair.model.parameters(), 1.0)
    torch.nn.utils.clip_grad_value_(pair.ref_model.parameters(), 0.01)
    pair.opt.clip_grad_value_(0.01)
    pair.step()
    pair.check(world_size, "after clip_grad_value_")


def optimizer_state_dicts(rank: int, world_size: int, *, optim: str, layout: str, groups: bool = False) -> None:
    """state_dict() is torch's, equal to the plain optimizer's; loading a perturbed one into both
    keeps them together."""
    pair = Pair(optim, LAYOUTS[layout], groups=groups)
    for step in range(3):
        pair.backward(batch(rank, step))
        pair.step()
    ours, ref = pair.opt.state_dict(), pair.ref_opt.state_dict()
    assert sorted(ours["state"]) == sorted(ref["state"])
    for i, st in ref["state"].items():
        assert sorted(ours["state"][i]) == sorted(st)
        for k, v in st.items():
            torch.testing.assert_close(ours["state"][i][k], v, rtol=RTOL, atol=ATOL, msg=f"state[{i}][{k!r}]")
    assert ours["param_groups"] == ref["param_groups"]
    perturb_state(ref)
    pair.ref_opt.load_state_dict(ref)
    pair.opt.load_state_dict(ref)
    train(pair, rank, world_size, range(3, 5), "after load_state_dict")


def module_state_dicts(rank: int, world_size: int) -> None:
    """ZeRO3.state_dict() is DDP's (keys module.*, whole tensors); load_state_dict of a changed one
    sets every rank's slices, and training goes on together."""
    pair = Pair("adam", LAYOUTS["four_buckets"], model=Shared())
    pair.backward(batch(rank, 0))
    pair.step()
    ours, ref = pair.zero.state_dict(), pair.ref_ddp.state_dict()
    assert list(ours) == list(ref)
    for k, v in ref.items():
        assert torch.equal(ours[k], v) or world_size > 2, k
    changed = {k: v * 0.5 + 0.01 for k, v in ref.items()}
    pair.zero.load_state_dict(changed)
    pair.ref_ddp.load_state_dict(changed)
    train(pair, rank, world_size, range(1, 3), "after load_state_dict")


def closure_and_scheduler(rank: int, world_size: int) -> None:
    pair = Pair("sgd_momentum", LAYOUTS["four_buckets"])
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (pair.opt, pair.ref_opt)]
    for step in range(3):
        loss, ref_loss = pair.closure_step(batch(rank, step))
        assert torch.equal(loss, ref_loss) or world_size > 2
        for s in scheds:
            s.step()
        assert pair.opt.param_groups[0]["lr"] == pair.ref_opt.param_groups[0]["lr"]
        pair.check(world_size, f"step {step}")


def eval_between_steps(rank: int, world_size: int) -> None:
    """A forward under no_grad (evaluation) frees every bucket and changes nothing."""
    pair = Pair("adam", LAYOUTS["four_buckets"])
    for step in range(2):
        pair.backward(batch(rank, step))
        pair.step()
        with torch.no_grad():
            out, ref_out = pair.zero(batch(rank, 10 + step)), pair.ref_ddp(batch(rank, 10 + step))
        assert all(s == "free" for s in pair.zero._buckets.state), pair.zero._buckets.state
        assert torch.equal(out, ref_out) or world_size > 2
        pair.check(world_size, f"step {step}")


def no_future_warning(rank: int, world_size: int) -> None:
    """torch 2.13's deprecated all_gather_into_tensor / reduce_scatter_tensor are not called:
    the flat collectives (NCCL's path, forced here) warn nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = ZeRO3(make_model(), bucket_cap_mb=0.0001)
        use_flat_collectives(model)
        opt = ZeRO3Optimizer(model, torch.optim.Adam, lr=0.01)
        for step in range(2):
            model(batch(rank, step)).pow(2).mean().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        opt.state_dict()
        model.state_dict()


def step_in_backward(rank: int, world_size: int, *, optim: str, layout: str, groups: bool = False) -> None:
    """ZeRO3Optimizer(step_in_backward=True): after each backward the parameters and the state are
    torch DDP + the optimizer's after backward and step(), already before the user's (now empty)
    step(); each bucket's gradient slice is dropped as it is stepped, so one is alive at a time.
    Memory first: each bucket steps before the next module's backward gathers."""
    pair = Pair(optim, LAYOUTS[layout], groups=groups, optimizer_options={"step_in_backward": True})
    alive, events, step_bucket = [], [], pair.zero._grads.on_slice_reduced
    assert step_bucket is not None

    def spy(b: int) -> None:
        alive.append(sum(g is not None for g in pair.zero._grads.slices))
        events.append("step")
        step_bucket(b)
    pair.zero._grads.on_slice_reduced = spy
    gather = pair.zero._schedule._gather
    pair.zero._schedule._gather = lambda *a: (events.append("gather") if a[-1] == "backward" else None, gather(*a))[1]
    for step in range(NUM_STEPS):
        del events[:]
        pair.backward(batch(rank, step))
        # Memory first: only the last bucket steps after the backward's last gather; the one before
        # it finished reducing (and stepped) before the last module gathered (the default's
        # overlapping order would leave two steps here: 'gather, gather, step, step').
        last_gather = max(i for i, e in enumerate(events) if e == "gather")
        assert events[last_gather + 1:] == ["step"], events
        assert pair.opt.grad_numel() == 0, f"step {step}: a gradient slice outlived its bucket's step"
        pair.ref_opt.step()
        pair.ref_opt.zero_grad()
        pair.check(world_size, f"step {step}, before step()")
        pair.check_state(f"step {step}")
        pair.opt.step()  # a user's unchanged loop: nothing left to do
        pair.opt.zero_grad()
        pair.check(world_size, f"step {step}, after step()")
    assert alive and max(alive) == 1, alive


def step_in_backward_habits(rank: int, world_size: int) -> None:
    """With step_in_backward: accumulation under no_sync() (DDP's), a closure and a scheduler as
    with torch's loop; clipping and a second in-backward optimizer refused by name."""
    pair = Pair("adamw", LAYOUTS["four_buckets"], optimizer_options={"step_in_backward": True})
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (pair.opt, pair.ref_opt)]
    for step in range(2):
        with pair.zero.no_sync(), pair.ref_ddp.no_sync():
            pair.backward(batch(rank, 3 * step))
        pair.check(world_size, f"step {step}: no_sync stepped")
        loss, ref_loss = pair.closure_step(batch(rank, 3 * step + 1))
        assert torch.equal(loss, ref_loss) or world_size > 2
        for s in scheds:
            s.step()
        pair.check(world_size, f"step {step}")
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_: this optimizer was made with step_in_backward=True"):
        pair.opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match=r"clip_grad_value_: .*step_in_backward=False"):
        pair.opt.clip_grad_value_(1.0)
    with pytest.raises(ValueError, match="already steps in its backward with another ZeRO3Optimizer"):
        ZeRO3Optimizer(pair.zero, torch.optim.SGD, lr=0.1, step_in_backward=True)


def mixed_precision(rank: int, world_size: int, *, reduce_dtype, step_in_backward: bool = False) -> None:
    """bfloat16 compute, float32 slices and state: against torch's FSDP2 with the same policy.

    Both compute the same bfloat16 forward and backward and step float32 masters with Adam, so at
    1 and 2 ranks the parameters agree bit for bit. At 3 ranks the float32 reduction is checked
    with rtol 1e-5 / atol 1e-6 (sums of three terms in another order); the bfloat16 reduction
    (``reduce_dtype=None``) for its first step only, with atol 5e-5: FSDP2 divides by 3 after the
    sum, hybrid before it (as DDP does), so a gradient element can differ by a bfloat16 rounding
    (2^-8 relative), and Adam's first step (``lr * g / (|g| + eps)``, lr 0.01) by up to ~4e-5;
    later steps compound it through the bfloat16 forward.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    base = make_model()
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    zero = ZeRO3(model, bucket_cap_mb=0.0001, mp_policy=policy)
    opt = ZeRO3Optimizer(zero, torch.optim.Adam, lr=0.01, step_in_backward=step_in_backward)
    fully_shard(ref, mesh=init_device_mesh("cpu", (world_size,)), mp_policy=policy)  # CPU even where a GPU is
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    tol = ({"rtol": 0, "atol": 0} if world_size <= 2 else
           {"rtol": 1e-5, "atol": 1e-6} if reduce_dtype == torch.float32 else {"rtol": 0, "atol": 5e-5})
    for step in range(3 if world_size <= 2 or reduce_dtype == torch.float32 else 1):
        x = batch(rank, step)
        out, ref_out = zero(x), ref(x)
        assert out.dtype == ref_out.dtype == torch.bfloat16
        out.float().pow(2).mean().backward()
        ref_out.float().pow(2).mean().backward()
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
        ours = zero.state_dict()
        for name, q in ref.named_parameters():
            p, q = ours[f"module.{name}"], q.full_tensor()
            assert p.dtype == torch.float32
            torch.testing.assert_close(p, q, **tol, msg=f"step {step}: {name}: {(p - q).abs().max().item():.3g}")


CASES = {f"parity[{o}-{layout}]": functools.partial(parity, optim=o, layout=layout)
         for o in OPTIMIZERS for layout in LAYOUTS if o == "adam" or layout in ("default", "four_buckets")}
CASES.update({f"parity[{o}-{layout}-two_groups]": functools.partial(parity, optim=o, layout=layout, groups=True)
              for o in OPTIMIZERS for layout in ("default", "six_buckets_prefetch_3")})
CASES["parity[adam-shared-tied-frozen]"] = functools.partial(parity, optim="adam", layout="four_buckets",
                                                            model=Shared())
CASES["parity[adam-shared-tied-frozen-kept]"] = functools.partial(parity, optim="adam", layout="four_buckets_kept",
                                                                 model=Shared())
CASES["reordered_order"] = reordered_order
CASES.update({f"accumulate[{layout}]": functools.partial(accumulate, layout=layout)
              for layout in ("default", "four_buckets_flat")})
CASES.update({f"no_sync[{layout}]": functools.partial(no_sync, layout=layout) for layout in ("default", "four_buckets")})
CASES.update({f"clip_norm[{p}-{layout}]": functools.partial(clip_norm, norm_type=p, layout=layout)
              for p, layout in ((2.0, "default"), (2.0, "four_buckets_flat"), (1.0, "four_buckets"),
                                (math.inf, "four_buckets"))})
CASES["clip_value_and_torch_refused"] = clip_value_and_torch_refused
CASES.update(CLIP_CASES)
CASES.update({f"optimizer_state_dicts[{o}-{layout}{'-two_groups' if g else ''}]": functools.partial(
    optimizer_state_dicts, optim=o, layout=layout, groups=g)
    for o, layout, g in (("adam", "four_buckets", False), ("adamw", "default", False),
                         ("sgd_momentum", "four_buckets", True), ("adamw", "six_buckets_prefetch_3", True))})
CASES["module_state_dicts"] = module_state_dicts
CASES["closure_and_scheduler"] = closure_and_scheduler
CASES["eval_between_steps"] = eval_between_steps
CASES["no_future_warning"] = no_future_warning
CASES.update({f"mixed_precision[{d}]": functools.partial(mixed_precision, reduce_dtype=d)
              for d in (torch.float32, None)})
CASES["mixed_precision[step_in_backward]"] = functools.partial(mixed_precision, reduce_dtype=torch.float32,
                                                              step_in_backward=True)
CASES.update({f"step_in_backward[{o}-{layout}{'-two_groups' if g else ''}]": functools.partial(
    step_in_backward, optim=o, layout=layout, groups=g)
    for o, layout, g in (("adam", "default", False), ("adam", "four_buckets", False),
                         ("adamw", "six_buckets_prefetch_3", True), ("sgd_momentum", "four_buckets_flat", False),
                         ("adam", "memory_policy", False), ("adam", "four_buckets_kept", False))})
CASES["step_in_backward_habits"] = step_in_backward_habits

from tests.torch_zero3 import _cases_anywhere  # noqa: E402 - merged: one spawn per world runs both tables

CASES.update(_cases_anywhere.CASES)

from tests.torch_zero3 import _cases_offload  # noqa: E402 - merged, as _cases_anywhere

CASES.update(_cases_offload.CASES)

from tests.torch_zero3 import _cases_init  # noqa: E402 - merged, as _cases_anywhere

CASES.update(_cases_init.CASES)
