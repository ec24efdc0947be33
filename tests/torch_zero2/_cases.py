"""Multi-process cases: hybrid's DDP + ZeRO2 against torch's DDP + the plain optimizer.

Tolerances: rtol 1.3e-6 / atol 1e-6 (torch's float32 defaults for ``assert_close``). Both sides
run the same elementwise optimizer math in float32; what differs is the reduction (a reduce-scatter
of ``grad / world_size`` against DDP's all-reduce of ``grad * (1 / world_size)``, either of which
may round the last bit differently) and the grouping of elements into foreach kernels.
Parameters are compared after every step, from the first: ZeRO2 skips no iteration.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from hybrid.torch import (DistributedDataParallel, ZeroRedundancyOptimizer, ZeRO2, hook_with_zero_step,
                          hook_with_zero_step_interleaved)
from tests.torch_zero._cases import OPTIMIZERS, FailingAdam, batch, make_model
from tests.torch_zero2._clip_cases import CLIP_CASES
from tests.torch_zero2._pair import ATOL, DDP_OPTIONS, NUM_STEPS, RTOL, Pair


def parity(rank: int, world_size: int, *, optim: str, ddp: str, flat: bool = False, groups: bool = False) -> None:
    pair = Pair(optim, DDP_OPTIONS[ddp], flat=flat, groups=groups)
    for step in range(NUM_STEPS):
        pair.backward(batch(rank, step))
        pair.check_sharded(world_size, f"step {step}")
        pair.step()
        pair.check(f"step {step}")
        pair.check_state(world_size, f"step {step}")


def accumulate(rank: int, world_size: int, *, ddp: str, flat: bool = False) -> None:
    """Two backward passes per step without zero_grad: the slices add up, as .grad does.

    The first step's second backward already runs on DDP's rebuilt buckets: the accumulated
    slices are re-cut to the new layout.
    """
    pair = Pair("adam", DDP_OPTIONS[ddp], flat=flat)
    for step in range(3):
        pair.backward(batch(rank, 2 * step))
        pair.backward(batch(rank, 2 * step + 1))
        pair.step()
        pair.check(f"step {step}")


def no_sync(rank: int, world_size: int) -> None:
    """A local backward under no_sync(), then a synced one: the sum of both is reduced."""
    pair = Pair("adamw", {})
    for step in range(3):
        with pair.ddp.no_sync(), pair.ref_ddp.no_sync():
            pair.backward(batch(rank, 2 * step))
        pair.backward(batch(rank, 2 * step + 1))
        pair.step()
        pair.check(f"step {step}")


def closure_and_scheduler(rank: int, world_size: int) -> None:
    """step(closure) returns the loss; a StepLR on the ZeRO2 optimizer changes the inner lr."""
    pair = Pair("sgd_momentum", {"bucket_cap_mb": 0.0002})
    sched = torch.optim.lr_scheduler.StepLR(pair.opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(pair.ref_opt, step_size=1, gamma=0.5)
    for step in range(3):
        loss, ref_loss = pair.closure_step(batch(rank, step))
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        sched.step()
        ref_sched.step()
        assert pair.opt.optim.param_groups[0]["lr"] == pair.ref_opt.param_groups[0]["lr"]
        pair.check(f"step {step}")


def assert_state_dicts_equal(ours: dict, ref: dict) -> None:
    """Same parameter indices, same state keys, state tensors within tolerance, same groups."""
    assert sorted(ours["state"]) == sorted(ref["state"]), (sorted(ours["state"]), sorted(ref["state"]))
    for i, st in ref["state"].items():
        assert sorted(ours["state"][i]) == sorted(st), (i, sorted(ours["state"][i]), sorted(st))
        for k, v in st.items():
            torch.testing.assert_close(ours["state"][i][k], v, rtol=RTOL, atol=ATOL, msg=f"state[{i}][{k!r}]")
    assert ours["param_groups"] == ref["param_groups"]


def perturb_state(state_dict: dict) -> None:
    """Halve every state tensor but the step count, so that only a real load keeps parity."""
    for st in state_dict["state"].values():
        for k, v in st.items():
            if k != "step":
                v.mul_(0.5)


def state_dicts(rank: int, world_size: int, *, optim: str, ddp: str, groups: bool = False) -> None:
    """state_dict() equals the plain optimizer's; loading the plain one's state, then stepping on,
    stays at parity (loaded after DDP's rebuild, so into the rebuilt layout)."""
    pair = Pair(optim, DDP_OPTIONS[ddp], groups=groups)
    for step in range(3):
        pair.backward(batch(rank, step))
        pair.step()
    ref = pair.ref_opt.state_dict()
    assert_state_dicts_equal(pair.opt.state_dict(), ref)
    # Perturb the reference state, load it into ZeRO2: the next steps must follow the loaded state.
    perturb_state(ref)
    pair.ref_opt.load_state_dict(ref)
    pair.opt.load_state_dict(ref)
    for step in range(3, 5):
        pair.backward(batch(rank, step))
        pair.step()
        pair.check(f"step {step} after load_state_dict")


def scheduler_per_group(rank: int, world_size: int) -> None:
    """A LambdaLR with one rule per group: each inner group follows its own, as in torch."""
    pair = Pair("adamw", {"bucket_cap_mb_list": [0.0001, 0.0002]}, groups=True)
    rules = [lambda step: 0.5 ** step, lambda step: 1.0 + step]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, rules) for o in (pair.opt, pair.ref_opt)]
    for step in range(4):
        pair.backward(batch(rank, step))
        pair.step()
        for sched in scheds:
            sched.step()
        assert [g["lr"] for g in pair.opt.optim.param_groups] == [g["lr"] for g in pair.ref_opt.param_groups]
        pair.check(f"step {step}")


def join(rank: int, world_size: int, *, optim: str, ddp: str, flat: bool = False) -> None:
    """Uneven inputs (rank r runs NUM_STEPS + r batches) under ``Join([ddp, zero2])`` equal torch
    DDP + the plain optimizer under ``ddp.join()`` (joined ranks contribute zeros, divided by the
    initial world size), and every rank ends with the same parameters."""
    pair = Pair(optim, DDP_OPTIONS[ddp], flat=flat)
    steps = NUM_STEPS + rank
    with Join([pair.ddp, pair.opt]):
        for step in range(steps):
            pair.ddp(batch(rank, step)).pow(2).mean().backward()
            pair.opt.step()
            pair.opt.zero_grad()
    with pair.ref_ddp.join():
        for step in range(steps):
            pair.ref_ddp(batch(rank, step)).pow(2).mean().backward()
            pair.ref_opt.step()
            pair.ref_opt.zero_grad()
    pair.check("after Join")
    flat_params = torch.cat([p.detach().reshape(-1) for p in pair.model.parameters()])
    everyone = [torch.empty_like(flat_params) for _ in range(world_size)]
    dist.all_gather(everyone, flat_params)
    for r, other in enumerate(everyone):
        assert torch.equal(other, flat_params), f"after Join, rank {r}'s parameters differ from rank {rank}'s"


def ranks_agree(rank: int, world_size: int) -> None:
    """After a step every rank holds the same parameters (the all-gather really ran)."""
    pair = Pair("adam", {"bucket_cap_mb": 0.0002})
    for step in range(2):
        pair.backward(batch(rank, step))
        pair.step()
    flat = torch.cat([p.detach().reshape(-1) for p in pair.model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    for r, other in enumerate(everyone):
        assert torch.equal(other, flat), f"rank {r}'s parameters differ from rank {rank}'s"


CASES = {f"parity[{o}-{d}]": functools.partial(parity, optim=o, ddp=d)
         for o in OPTIMIZERS for d in DDP_OPTIONS if d not in ("three_buckets_static", "four_buckets")}
CASES["parity[adam-three_buckets_static]"] = functools.partial(parity, optim="adam", ddp="three_buckets_static")
CASES.update({f"parity[adam-{d}-flat_collectives]": functools.partial(parity, optim="adam", ddp=d, flat=True)
              for d in ("default", "static_graph", "two_buckets", "three_buckets_view")})
CASES["accumulate[three_buckets_view-flat_collectives]"] = functools.partial(
    accumulate, ddp="three_buckets_view", flat=True)
CASES.update({f"accumulate[{d}]": functools.partial(accumulate, ddp=d) for d in ("default", "three_buckets_view")})
CASES["no_sync"] = no_sync
CASES.update({f"state_dicts[{o}-{d}]": functools.partial(state_dicts, optim=o, ddp=d)
              for o, d in (("adam", "three_buckets_view"), ("sgd_momentum", "two_buckets"), ("adamw", "default"))})
CASES["closure_and_scheduler"] = closure_and_scheduler
CASES.update({f"parity[{o}-{d}-two_groups]": functools.partial(parity, optim=o, ddp=d, groups=True)
              for o in OPTIMIZERS for d in ("default", "three_buckets_view", "four_buckets")})
CASES.update({f"parity[{o}-four_buckets-two_groups-flat_collectives]": functools.partial(
    parity, optim=o, ddp="four_buckets", groups=True, flat=True) for o in ("adamw", "sgd_momentum")})
CASES.update({f"state_dicts[{o}-{d}-two_groups]": functools.partial(state_dicts, optim=o, ddp=d, groups=True)
              for o, d in (("adamw", "three_buckets_view"), ("sgd_momentum", "four_buckets"))})
CASES["scheduler_per_group"] = scheduler_per_group
CASES["ranks_agree"] = ranks_agree
CASES.update(CLIP_CASES)
CASES.update({f"join[{o}-{d}{'-flat_collectives' if f else ''}]": functools.partial(join, optim=o, ddp=d, flat=f)
              for o, d, f in (("adam", "default", False), ("sgd_momentum", "three_buckets_view", False),
                              ("adamw", "two_buckets", True))})


# ---- the ZeRO step overlapped with backward (hook_with_zero_step / _interleaved) ----------------

HOOKS = {"step": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}
# With shard_buckets, three_buckets_* and four_buckets cut into at most world_size runs before and
# after DDP's rebuild; "default" and "two_buckets" do not (one bucket, world sizes 2 and 3), so
# those plans fall back to whole buckets with a warning (torch would silently drop a run).
OVERLAP_DDP_OPTIONS = {False: ("default", "bucket_view", "static_graph", "three_buckets_view"),
                       True: ("default", "two_buckets", "three_buckets_view", "three_buckets_static", "four_buckets")}


def torch_skips(ddp: str) -> int:
    """Backward passes torch's overlap hooks run without updating: 2, or 3 with static_graph."""
    return 3 if DDP_OPTIONS[ddp].get("static_graph") else 2


def overlap(rank: int, world_size: int, *, hook: str, shard_buckets: bool, ddp: str, optim: str = "adam",
            first: bool = False) -> None:
    """Parameters after every backward equal DDP + optimizer.step(), torch's skipped iterations
    (a script feeding dummy batches there) included; ``first``: updates from the first iteration
    on (``update_from_first_iteration=True``). (torch's own hooks refuse gloo.)"""
    cls, kwargs = OPTIMIZERS[optim]
    base = make_model()
    model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp_module = DistributedDataParallel(model, **DDP_OPTIONS[ddp])
    ref_ddp = TorchDDP(ref_model, **DDP_OPTIONS[ddp])
    zero = ZeroRedundancyOptimizer(model.parameters(), cls, overlap_with_ddp=True, **kwargs)
    ddp_module.register_comm_hook(None, HOOKS[hook](allreduce_hook, ddp_module, zero, shard_buckets=shard_buckets,
                                                    update_from_first_iteration=first))
    ref_opt = cls(ref_model.parameters(), **kwargs)
    skip = 0 if first else torch_skips(ddp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _overlap_steps(rank, ddp_module, ref_ddp, zero, ref_opt, model, ref_model, skip=skip, steps=skip + 2)
    fell_back = any("assigned with shard_buckets=False" in str(w.message) for w in caught)
    # The one-bucket plans cut into too many runs at world sizes 2 and 3 (see OVERLAP_DDP_OPTIONS);
    # after torch's skipped iterations the hook first plans on DDP's rebuilt buckets.
    if first:
        assert fell_back == (shard_buckets and world_size > 1 and ddp in ("default", "two_buckets")), fell_back
    else:
        assert not fell_back or (shard_buckets and world_size > 1), fell_back


def _overlap_steps(rank, ddp_module, ref_ddp, zero, ref_opt, model, ref_model, *, skip=0, steps=NUM_STEPS):
    for step in range(steps):
        x = batch(rank, step)
        ddp_module(x).pow(2).mean().backward()  # the step runs inside
        ref_ddp(x).pow(2).mean().backward()
        if step >= skip:
            ref_opt.step()
        zero.zero_grad()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=f"step {step}: {name}")


def failed_step(rank: int, world_size: int, *, mode: str) -> None:
    """A local step that raises on every rank: the parameters stay as they were, the error
    reaches the caller, and the next iterations match DDP + Adam that skipped that step.
    ``mode``: ZeRO2, or an overlap hook with torch's two skipped iterations."""
    base = make_model()
    model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp_module = DistributedDataParallel(model)
    ref_ddp, ref_opt = TorchDDP(ref_model), torch.optim.Adam(ref_model.parameters(), lr=0.01)
    if mode == "zero2":
        opt, skip = ZeRO2(ddp_module, FailingAdam, lr=0.01), 0
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), FailingAdam, overlap_with_ddp=True, lr=0.01)
        ddp_module.register_comm_hook(None, HOOKS[mode](allreduce_hook, ddp_module, opt))
        skip = 2
    fails = (skip + 1, skip + 2)
    for step in range(skip + 5):
        x = batch(rank, step)
        before = [p.detach().clone() for p in model.parameters()]
        FailingAdam.FAIL = step in fails
        try:
            ddp_module(x).pow(2).mean().backward()  # overlap: the step runs inside
            if mode == "zero2":
                opt.step()
        except FloatingPointError as e:
            assert step in fails and "nan guard" in str(e), (step, e)
            for (name, p), q in zip(model.named_parameters(), before):
                assert torch.equal(p.detach(), q), f"step {step}: a failed step moved {name}"
        else:
            # With the overlap hooks a rank that owns no bucket slice runs no local step.
            owns = mode == "zero2" or bool(opt._overlap_runtime.optims)
            assert step not in fails or not owns, f"step {step}: the failing step did not raise"
        finally:
            FailingAdam.FAIL = False
        ref_ddp(x).pow(2).mean().backward()
        if step >= skip and step not in fails:
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=f"step {step}: {name}")


def failed_step_one_rank(rank: int, world_size: int) -> None:
    """ZeRO2's local step raises on rank 0 only: rank 0 raises with its slices unchanged, the
    other ranks' gathers still pair up (no hang), every rank ends with the same parameters, and
    the next steps work."""
    model = make_model()
    ddp_module = DistributedDataParallel(model, bucket_cap_mb=0.0002)
    opt = ZeRO2(ddp_module, FailingAdam, lr=0.01)
    for step in range(4):
        ddp_module(batch(rank, step)).pow(2).mean().backward()
        mine = [opt._my_slice(b).clone() for b in range(len(opt._flat_params))]
        FailingAdam.FAIL = step == 2 and rank == 0  # after DDP rebuilt its buckets (step 1)
        try:
            opt.step()
        except FloatingPointError as e:
            assert FailingAdam.FAIL and "nan guard" in str(e), (step, e)
            for b, before in enumerate(mine):
                assert torch.equal(opt._my_slice(b), before), f"step {step}: a failed step moved bucket {b}"
        else:
            assert not FailingAdam.FAIL, f"step {step}: the failing step did not raise"
        finally:
            FailingAdam.FAIL = False
        opt.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)
        for r, other in enumerate(everyone):
            assert torch.equal(other, flat), f"step {step}: rank {r}'s parameters differ from rank {rank}'s"


def overlap_state_dicts(rank: int, world_size: int, *, hook: str, shard_buckets: bool, ddp: str) -> None:
    """With overlap, the consolidated state_dict equals the plain optimizer's (torch's format);
    loading a perturbed one, into the running hook and into a fresh one before its first
    backward, keeps parameters at parity with the plain optimizer loaded the same way."""
    cls, kwargs = OPTIMIZERS["adam"]

    def overlapped(model):
        ddp_module = DistributedDataParallel(model, **DDP_OPTIONS[ddp])
        zero = ZeroRedundancyOptimizer(model.parameters(), cls, overlap_with_ddp=True, **kwargs)
        ddp_module.register_comm_hook(None, HOOKS[hook](allreduce_hook, ddp_module, zero,
                                                        shard_buckets=shard_buckets, update_from_first_iteration=True))
        return ddp_module, zero

    base = make_model()
    model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp_module, zero = overlapped(model)
    ref_ddp, ref_opt = TorchDDP(ref_model, **DDP_OPTIONS[ddp]), cls(ref_model.parameters(), **kwargs)
    with pytest.raises(RuntimeError, match="has not been consolidated"):
        zero.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-bucket plan's shard_buckets fallback
        _overlap_steps(rank, ddp_module, ref_ddp, zero, ref_opt, model, ref_model)
    zero.consolidate_state_dict(to=world_size - 1)
    ref = ref_opt.state_dict()
    if rank == world_size - 1:
        assert_state_dicts_equal(zero.state_dict(), ref)
    perturb_state(ref)
    # torch's load_state_dict keeps the dict's tensors as its state: each plain optimizer gets a copy.
    ref_opt.load_state_dict(copy.deepcopy(ref))
    zero.load_state_dict(ref)  # into the running hook
    fresh_model = copy.deepcopy(model)
    fresh_ddp, fresh_zero = overlapped(fresh_model)
    fresh_zero.load_state_dict(ref)  # before the hook has seen a backward
    fresh_ref = copy.deepcopy(ref_model)
    fresh_ref_ddp = TorchDDP(fresh_ref, **DDP_OPTIONS[ddp])
    fresh_ref_opt = cls(fresh_ref.parameters(), **kwargs)
    fresh_ref_opt.load_state_dict(copy.deepcopy(ref))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _overlap_steps(rank, ddp_module, ref_ddp, zero, ref_opt, model, ref_model)
        _overlap_steps(rank, fresh_ddp, fresh_ref_ddp, fresh_zero, fresh_ref_opt, fresh_model, fresh_ref)


def overlap_join(rank: int, world_size: int, *, hook: str, shard_buckets: bool, ddp: str) -> None:
    """Uneven inputs (rank r runs NUM_STEPS + r batches) under ``Join([ddp, zero])`` with the step in
    the hook: a joined rank's DDP runs the hook on zero buckets, so it still steps and sends its
    share; equal to torch DDP + the plain optimizer under ``ddp.join()``."""
    cls, kwargs = OPTIMIZERS["adam"]
    base = make_model()
    model, ref_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp_module = DistributedDataParallel(model, **DDP_OPTIONS[ddp])
    zero = ZeroRedundancyOptimizer(model.parameters(), cls, overlap_with_ddp=True, **kwargs)
    ddp_module.register_comm_hook(None, HOOKS[hook](allreduce_hook, ddp_module, zero, shard_buckets=shard_buckets,
                                                    update_from_first_iteration=True))
    ref_ddp, ref_opt = TorchDDP(ref_model, **DDP_OPTIONS[ddp]), cls(ref_model.parameters(), **kwargs)
    steps = NUM_STEPS + rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-bucket plan's shard_buckets fallback
        with Join([ddp_module, zero]):
            for step in range(steps):
                ddp_module(batch(rank, step)).pow(2).mean().backward()
                zero.zero_grad()
    with ref_ddp.join():
        for step in range(steps):
            ref_ddp(batch(rank, step)).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=f"after Join: {name}")


def overlap_step_is_a_no_op(rank: int, world_size: int) -> None:
    """With overlap_with_ddp=True, ZeroRedundancyOptimizer.step() changes nothing (torch's contract)."""
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    model(batch(rank, 0)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    assert zero.step() is None
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


CASES.update({f"overlap[{h}-{'shard' if s else 'whole'}-{d}]":
              functools.partial(overlap, hook=h, shard_buckets=s, ddp=d)
              for h in HOOKS for s in (False, True) for d in OVERLAP_DDP_OPTIONS[s]})
CASES.update({f"overlap[{h}-whole-two_buckets-sgd_momentum]": functools.partial(
    overlap, hook=h, shard_buckets=False, ddp="two_buckets", optim="sgd_momentum") for h in HOOKS})
CASES.update({f"overlap[{h}-{'shard' if s else 'whole'}-{d}-first]": functools.partial(
    overlap, hook=h, shard_buckets=s, ddp=d, first=True)
    for h, s, d in (("step", False, "default"), ("interleaved", False, "static_graph"),
                    ("step", True, "default"), ("interleaved", True, "three_buckets_view"))})
CASES.update({f"failed_step[{m}]": functools.partial(failed_step, mode=m) for m in ("zero2", *HOOKS)})
CASES["failed_step_one_rank[zero2]"] = failed_step_one_rank
CASES["overlap_step_is_a_no_op"] = overlap_step_is_a_no_op
CASES.update({f"overlap_join[{h}-{'shard' if s else 'whole'}-{d}]": functools.partial(
    overlap_join, hook=h, shard_buckets=s, ddp=d)
    for h, s, d in (("step", False, "two_buckets"), ("interleaved", True, "three_buckets_view"))})
CASES.update({f"overlap_state_dicts[{h}-{'shard' if s else 'whole'}-{d}]": functools.partial(
    overlap_state_dicts, hook=h, shard_buckets=s, ddp=d)
    for h, s, d in (("step", False, "default"), ("interleaved", True, "three_buckets_view"),
                    ("step", True, "four_buckets"))})
