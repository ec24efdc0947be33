"""Multi-process cases: hybrid's ZeroRedundancyOptimizer against torch's own, and against DDP + the
local optimizer. Each case runs on every rank of a gloo world (see ``_harness``).

Tolerances. Against torch's ZeroRedundancyOptimizer we demand bit equality: both run the same DDP
all-reduce, the same local optimizer class on the same owned tensors (same partition) and
broadcast copies bits, so any difference is a bug. Against DDP + the plain optimizer (all
parameters in one optimizer, float32) we allow rtol 1.3e-6 / atol 1e-6, torch's float32 defaults
for ``assert_close``: the update math is the same optimizer, only its grouping of tensors into
foreach kernels differs.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.torch import ZeroRedundancyOptimizer

RTOL, ATOL = 1.3e-6, 1e-6

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def make_model() -> torch.nn.Module:
    # Tensor sizes 35, 7, 42, 6, 18, 3, 12, 4: uneven enough that the greedy partition matters.
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6),
                               torch.nn.Tanh(), torch.nn.Linear(6, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 4))


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 5, generator=g)


def param_groups(model: torch.nn.Module, two_groups: bool):
    params = list(model.parameters())
    if not two_groups:
        return params
    # The second group gets its own lr so that a group mix-up changes the numbers.
    return [{"params": params[:4]}, {"params": params[4:], "lr": 0.003}]


def owned_indices_torch(opt: TorchZero) -> list[list[list[int]]]:
    index = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return [[[index[p] for p in g["params"]] for g in groups] for groups in opt._partition_parameters()]


def owned_indices(opt: ZeroRedundancyOptimizer) -> list[list[list[int]]]:
    return [[list(g) for g in r] for r in opt.partition.per_rank]


def check_honest_state(opt: ZeroRedundancyOptimizer, rank: int) -> None:
    """The local optimizer sees exactly this rank's share, and keeps state for nothing else."""
    params = [p for g in opt.param_groups for p in g["params"]]
    owned = [params[i] for i in opt.partition.owned(rank)]
    local = [p for g in opt.optim.param_groups for p in g["params"]]
    assert [id(p) for p in local] == [id(p) for p in owned], "local optimizer params != owned share"
    assert {id(p) for p in opt.optim.state} <= {id(p) for p in owned}, "state kept for a non-owned param"


def assert_params(model, ref, what: str, *, exact: bool) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if exact:
            assert torch.equal(p.detach(), q.detach()), f"{what}: {name} differs (bitwise)"
        else:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=f"{what}: {name}")


def assert_state_dicts(a: dict, b: dict, what: str, *, exact: bool) -> None:
    assert sorted(a["state"]) == sorted(b["state"]), f"{what}: state indices {sorted(a['state'])} != {sorted(b['state'])}"
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        assert (sa is None) == (sb is None) and (sa is None or sorted(sa) == sorted(sb)), f"{what}: state[{i}] keys"
        for k in sa or ():
            va, vb = sa[k], sb[k]
            if exact:
                assert torch.equal(torch.as_tensor(va), torch.as_tensor(vb)), f"{what}: state[{i}][{k!r}]"
            else:
                torch.testing.assert_close(torch.as_tensor(va), torch.as_tensor(vb), rtol=RTOL, atol=ATOL,
                                           msg=f"{what}: state[{i}][{k!r}]")
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]], f"{what}: groups"
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        for k in ga.keys() & gb.keys():
            assert k == "params" or ga[k] == gb[k], f"{what}: param group {k!r}: {ga[k]!r} != {gb[k]!r}"


def train_step(ddp, opt, x, *, closure: bool = False):
    def loss_fn():
        opt.zero_grad()
        loss = ddp(x).pow(2).mean()
        loss.backward()
        return loss
    if closure:
        return opt.step(closure=loss_fn)
    loss = loss_fn()
    opt.step()
    return loss


class Trio:
    """One model three times: hybrid ZeRO, torch's ZeRO and a plain optimizer, each under torch DDP."""

    def __init__(self, optim: str, *, two_groups=False, bucket_view=False, find_unused=False, **extra):
        cls, kwargs = OPTIMIZERS[optim]
        kwargs = {**kwargs, **extra}
        base = make_model()
        self.models = {k: copy.deepcopy(base) for k in ("hybrid", "torch", "plain")}
        self.ddps = {k: DDP(m, find_unused_parameters=find_unused) for k, m in self.models.items()}
        self.opts = {
            "hybrid": ZeroRedundancyOptimizer(param_groups(self.models["hybrid"], two_groups), cls,
                                              parameters_as_bucket_view=bucket_view, **kwargs),
            "torch": TorchZero(param_groups(self.models["torch"], two_groups), cls,
                               parameters_as_bucket_view=bucket_view, **kwargs),
            "plain": cls(param_groups(self.models["plain"], two_groups), **kwargs),
        }

    def step(self, x, *, closure=False):
        losses = {k: train_step(self.ddps[k], self.opts[k], x, closure=closure) for k in self.models}
        if closure:
            assert torch.equal(losses["hybrid"], losses["torch"]), "closure losses differ"
        self.check("step")

    def check(self, what: str):
        assert_params(self.models["hybrid"], self.models["torch"], f"{what} vs torch ZeRO", exact=True)
        assert_params(self.models["hybrid"], self.models["plain"], f"{what} vs DDP+plain", exact=False)


# -- cases ---------------------------------------------------------------------------------------

def parity(rank, world_size, *, optim, maximize=False, two_groups=False, bucket_view=False,
           flip=False, closure=False, steps=4):
    """Step by step parity; ``flip`` freezes one weight on step 1 and thaws it on step 3."""
    trio = Trio(optim, two_groups=two_groups, bucket_view=bucket_view, find_unused=flip, maximize=maximize)
    assert owned_indices(trio.opts["hybrid"]) == owned_indices_torch(trio.opts["torch"]), "ownership"
    for step in range(steps):
        if flip and step in (1, 3):
            for m in trio.models.values():
                m[2].weight.requires_grad_(step == 3)
        frozen = trio.models["hybrid"][2].weight.detach().clone()
        trio.step(batch(rank, step), closure=closure)
        check_honest_state(trio.opts["hybrid"], rank)
        if flip and step in (1, 2):
            assert torch.equal(trio.models["hybrid"][2].weight, frozen), "a frozen weight moved"
        if bucket_view:
            # Trainable parameters live in the broadcast buckets, frozen ones (as in torch) not.
            opt = trio.opts["hybrid"]
            ptrs = {t.untyped_storage().data_ptr() for r in opt._buckets for t in r}
            for p in (p for g in opt.param_groups for p in g["params"]):
                assert (p.untyped_storage().data_ptr() in ptrs) == p.requires_grad, f"step {step}: bucket views"


def ownership(rank, world_size):
    """Same partition as torch for several shapes and group splits, and no redundant state."""
    del rank
    shapes = [[(3, 4), (5,), (12,), (2, 2), (7, 3), (1,)], [(8,)] * 7, [(100,), (1,), (1,), (1,), (50, 2)]]
    for shape_list in shapes:
        for split in (None, 2, 4):
            params = [torch.nn.Parameter(torch.zeros(s)) for s in shape_list]
            arg = params if split is None else [{"params": params[:split]}, {"params": params[split:]}]
            ours = ZeroRedundancyOptimizer(arg, torch.optim.SGD, lr=0.1)
            theirs = TorchZero(arg, torch.optim.SGD, lr=0.1)
            assert owned_indices(ours) == owned_indices_torch(theirs), (shape_list, split)
            assert ours.partition.world_size == world_size


def torch_attributes(rank, world_size):
    """The attributes torch's tests and Join hooks reach for, with torch's values."""
    del rank
    for split in (None, 4):
        params = list(make_model().parameters())
        arg = params if split is None else [{"params": params[:split]}, {"params": params[split:], "lr": 0.2}]
        ours = ZeroRedundancyOptimizer(arg, torch.optim.SGD, lr=0.1)
        theirs = TorchZero(arg, torch.optim.SGD, lr=0.1)
        assert ours._all_params == theirs._all_params
        assert ours._param_to_rank == theirs._param_to_rank
        assert ours._param_to_index == theirs._param_to_index
        assert ours._index_to_param == theirs._index_to_param
        mine, ref = ours._partition_parameters(), theirs._partition_parameters()
        assert len(mine) == len(ref) == world_size
        for a, b in zip(mine, ref):
            assert [[id(p) for p in g["params"]] for g in a] == [[id(p) for p in g["params"]] for g in b]
            assert [g["lr"] for g in a] == [g["lr"] for g in b]


class FailingAdam(torch.optim.Adam):
    """Adam whose ``step`` raises before touching anything while ``FAIL`` is set (a NaN guard)."""

    FAIL = False

    def step(self, *args, **kwargs):
        if FailingAdam.FAIL:
            raise FloatingPointError("nan guard")
        return super().step(*args, **kwargs)


def failed_step(rank, world_size, *, bucket_view):
    """A step that raises on every rank leaves the parameters as they were, and the next step
    works: torch's ZeroRedundancyOptimizer beside ours, in the same processes."""
    base = make_model()
    models = {k: copy.deepcopy(base) for k in ("hybrid", "torch")}
    ddps = {k: DDP(m) for k, m in models.items()}
    opts = {"hybrid": ZeroRedundancyOptimizer(models["hybrid"].parameters(), FailingAdam,
                                              parameters_as_bucket_view=bucket_view, lr=0.01),
            "torch": TorchZero(models["torch"].parameters(), FailingAdam,
                               parameters_as_bucket_view=bucket_view, lr=0.01)}
    for step in range(4):
        FailingAdam.FAIL = step in (1, 2)
        try:
            for k in models:
                before = [p.detach().clone() for p in models[k].parameters()]
                try:
                    train_step(ddps[k], opts[k], batch(rank, step))
                except FloatingPointError:
                    assert FailingAdam.FAIL, f"{k}: raised without a failure"
                    for p, q in zip(models[k].parameters(), before):
                        assert torch.equal(p.detach(), q), f"{k}: a failed step moved a parameter"
                else:
                    assert not FailingAdam.FAIL, f"{k}: the failing step did not raise"
        finally:
            FailingAdam.FAIL = False
        assert_params(models["hybrid"], models["torch"], f"step {step} vs torch ZeRO", exact=True)


def add_param_group(rank, world_size, *, bucket_view):
    base = make_model()
    models = {k: copy.deepcopy(base) for k in ("hybrid", "torch", "plain")}
    ddps = {k: DDP(m) for k, m in models.items()}
    first = {k: list(m.parameters())[:2] for k, m in models.items()}
    rest = {k: list(m.parameters())[2:] for k, m in models.items()}
    opts = {"hybrid": ZeroRedundancyOptimizer(first["hybrid"], torch.optim.Adam,
                                              parameters_as_bucket_view=bucket_view, lr=0.01),
            "torch": TorchZero(first["torch"], torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=0.01),
            "plain": torch.optim.Adam(first["plain"], lr=0.01)}
    for step in range(4):
        if step == 2:
            for k, opt in opts.items():
                opt.add_param_group({"params": rest[k], "lr": 0.02})
            assert owned_indices(opts["hybrid"]) == owned_indices_torch(opts["torch"]), "ownership after add"
        for k in models:
            train_step(ddps[k], opts[k], batch(rank, step))
        check_honest_state(opts["hybrid"], rank)
        assert_params(models["hybrid"], models["torch"], f"step {step} vs torch ZeRO", exact=True)
        assert_params(models["hybrid"], models["plain"], f"step {step} vs DDP+plain", exact=False)


def lr_scheduler(rank, world_size, *, bucket_view):
    trio = Trio("sgd_momentum", two_groups=True, bucket_view=bucket_view)
    scheds = {k: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for k, o in trio.opts.items()}
    for step in range(4):
        trio.step(batch(rank, step))
        for s in scheds.values():
            s.step()
        lrs = {k: [g["lr"] for g in o.param_groups] for k, o in trio.opts.items()}
        # The scheduler writes the outer groups; bit parity on the next step shows the local
        # optimizer stepped with the new lr.
        assert lrs["hybrid"] == lrs["torch"] == lrs["plain"], lrs


def state_dict_exchange(rank, world_size, *, optim, bucket_view, maximize=False):
    """Consolidated state dicts equal torch's; dicts move hybrid <-> torch ZeRO <-> plain optimizer."""
    trio = Trio(optim, two_groups=True, bucket_view=bucket_view, maximize=maximize)
    for step in range(3):
        trio.step(batch(rank, step))
    errors = []
    for k in ("hybrid", "torch"):
        try:
            trio.opts[k].state_dict()
        except RuntimeError as e:
            errors.append(str(e))
    assert len(errors) == 2 and errors[0] == errors[1], f"state_dict() before consolidating: {errors}"

    trio.opts["hybrid"].consolidate_state_dict(to=0)
    trio.opts["torch"].consolidate_state_dict(to=0)
    box = [None]
    if rank == 0:
        sds = {"hybrid": trio.opts["hybrid"].state_dict(), "torch": trio.opts["torch"].state_dict(),
               "plain": trio.opts["plain"].state_dict()}
        assert_state_dicts(sds["hybrid"], sds["torch"], "hybrid vs torch state dict", exact=True)
        assert_state_dicts(sds["hybrid"], sds["plain"], "hybrid vs plain state dict", exact=False)
        box = [sds]
    dist.broadcast_object_list(box, src=0)
    sds = box[0]
    cls, kwargs = OPTIMIZERS[optim]
    kwargs = {**kwargs, "maximize": maximize}

    # Fresh optimizers over copies of the trained model, each loaded from another kind's dict.
    trained = trio.models["torch"]
    loaders = {
        "hybrid<-torch": lambda ps: ZeroRedundancyOptimizer(ps, cls, parameters_as_bucket_view=bucket_view, **kwargs),
        "hybrid<-plain": lambda ps: ZeroRedundancyOptimizer(ps, cls, parameters_as_bucket_view=bucket_view, **kwargs),
        "torch<-hybrid": lambda ps: TorchZero(ps, cls, parameters_as_bucket_view=bucket_view, **kwargs),
        "plain<-hybrid": lambda ps: cls(ps, **kwargs),
    }
    fresh = {}
    for name, make in loaders.items():
        model = copy.deepcopy(trained)
        opt = make(param_groups(model, True))
        source = copy.deepcopy(sds[name.split("<-")[1]])
        keep = copy.deepcopy(source)
        opt.load_state_dict(source)
        if isinstance(opt, ZeroRedundancyOptimizer):
            assert_state_dicts(source, keep, f"{name}: load_state_dict changed its input", exact=True)
            check_honest_state(opt, rank)
        fresh[name] = (DDP(model), opt)

    # Loading then consolidating gives the loaded dict back.
    opt = fresh["hybrid<-plain"][1]
    opt.consolidate_state_dict(to=world_size - 1)
    if rank == world_size - 1:
        assert_state_dicts(opt.state_dict(), sds["plain"], "plain -> hybrid -> state_dict", exact=True)

    x = batch(rank, 99)
    trio.step(x)
    for name, (ddp, opt) in fresh.items():
        train_step(ddp, opt, x)
    # Fresh DDPs reduce in their first-iteration bucket layout, the trio's in its rebuilt one;
    # with 3 ranks gloo may then sum in another order, so only fresh vs fresh can be bit-exact.
    models = {name: ddp.module for name, (ddp, _) in fresh.items()}
    assert_params(models["hybrid<-torch"], models["torch<-hybrid"], "one step after loading", exact=True)
    for name, model in models.items():
        assert_params(model, trio.models["hybrid"], f"one step after {name}", exact=False)


def subgroup(rank, world_size, *, bucket_view):
    """A process group that is not the world: group ranks differ from global ranks."""
    members = list(range(1, world_size)) if world_size > 1 else [0]
    group = dist.new_group(members)  # every rank must call new_group
    if rank not in members:
        return
    base = make_model()
    models = {k: copy.deepcopy(base) for k in ("hybrid", "torch")}
    ddps = {k: DDP(m, process_group=group) for k, m in models.items()}
    opts = {"hybrid": ZeroRedundancyOptimizer(models["hybrid"].parameters(), torch.optim.Adam, process_group=group,
                                              parameters_as_bucket_view=bucket_view, lr=0.01),
            "torch": TorchZero(models["torch"].parameters(), torch.optim.Adam, process_group=group,
                               parameters_as_bucket_view=bucket_view, lr=0.01)}
    assert opts["hybrid"].rank == members.index(rank) and opts["hybrid"].world_size == len(members)
    for step in range(3):
        for k in models:
            train_step(ddps[k], opts[k], batch(rank, step))
        assert_params(models["hybrid"], models["torch"], f"step {step} on a subgroup", exact=True)
    for k in opts:
        opts[k].consolidate_state_dict(to=len(members) - 1)
    if rank == members[-1]:
        assert_state_dicts(opts["hybrid"].state_dict(), opts["torch"].state_dict(), "subgroup state dict", exact=True)


def ranks_disagree(rank, world_size):
    """Different parameters on different ranks: a ValueError on every rank, not a hang."""
    same = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 3))]
    ZeroRedundancyOptimizer(same, torch.optim.SGD, lr=0.1)  # agreeing ranks: no error
    differ = [torch.nn.Parameter(torch.zeros(4 + rank)), torch.nn.Parameter(torch.zeros(2, 3))]
    try:
        ZeroRedundancyOptimizer(differ, torch.optim.SGD, lr=0.1)
        raised = None
    except ValueError as e:
        raised = str(e)
    if world_size == 1:
        assert raised is None, raised
    else:
        assert raised is not None and "different" in raised, raised
    # A group added on one rank only is caught too.
    opt = ZeroRedundancyOptimizer(same, torch.optim.SGD, lr=0.1)
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3 if rank == 0 else 5))]})
        raised = None
    except ValueError as e:
        raised = str(e)
    assert (raised is None) == (world_size == 1), raised
    if world_size > 1:  # rolled back: no group that the local optimizer lacks
        assert len(opt.param_groups) == len(opt.optim.param_groups) == len(opt.partition.per_rank[rank]) == 1


class SGDWithStepKwarg(torch.optim.SGD):
    """An optimizer whose ``step`` takes an extra keyword (ZeRO must forward it untouched)."""

    def step(self, closure=None, *, grad_scale: float = 1.0):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        return super().step(closure)


def step_kwargs(rank, world_size):
    base = make_model()
    models = {k: copy.deepcopy(base) for k in ("hybrid", "torch")}
    ddps = {k: DDP(m) for k, m in models.items()}
    opts = {"hybrid": ZeroRedundancyOptimizer(models["hybrid"].parameters(), SGDWithStepKwarg, lr=0.1),
            "torch": TorchZero(models["torch"].parameters(), SGDWithStepKwarg, lr=0.1)}
    before = [p.detach().clone() for p in models["hybrid"].parameters()]
    for k in models:
        opts[k].zero_grad()
        ddps[k](batch(rank, 0)).pow(2).mean().backward()
        opts[k].step(grad_scale=0.0 if k == "hybrid" else 1.0)
    # grad_scale=0 reached the local optimizer: nothing moved. Then the same call as torch.
    assert all(torch.equal(p, q) for p, q in zip(models["hybrid"].parameters(), before)), "kwarg lost"
    models["hybrid"].load_state_dict(models["torch"].state_dict())
    for k in models:
        opts[k].zero_grad()
        ddps[k](batch(rank, 1)).pow(2).mean().backward()
        opts[k].step(grad_scale=0.5)
    assert_params(models["hybrid"], models["torch"], "step(grad_scale=0.5)", exact=True)


class _GradSetter(Joinable):
    """After joining, a rank sets the ground-truth gradients before the ZeRO hook steps."""

    def __init__(self, params, grads):
        super().__init__()
        self.params, self.grads, self.index = params, grads, 0

    def join_hook(self, **kwargs):
        setter = self

        class _Hook(JoinHook):
            def main_hook(self):
                for p, g in zip(setter.params, setter.grads[setter.index]):
                    p.grad = g.clone()
                setter.index += 1
        return _Hook()

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


def join_uneven_vs_torch(rank, world_size, *, bucket_view):
    """``Join([ddp, zero])`` with rank r running 3 + r inputs: bit-equal to torch's ZeRO."""
    base = make_model()
    finals = {}
    for name, cls in (("hybrid", ZeroRedundancyOptimizer), ("torch", TorchZero)):
        model = copy.deepcopy(base)
        ddp = DDP(model)
        opt = cls(model.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=0.01)
        with Join([ddp, opt]):
            for step in range(3 + rank):
                train_step(ddp, opt, batch(rank, step))
        finals[name] = model
    assert_params(finals["hybrid"], finals["torch"], "after Join", exact=True)


def join_uneven_ground_truth(rank, world_size, *, bucket_view):
    """``Join([ddp, zero])`` equals DDP + a plain Adam (torch's test_zero_join, with DDP in the Join).

    The ground truth is recorded on the last rank, which never joins early. A rank that joined
    early still steps its share in the ZeRO hook; the grad setter gives it the ground truth's
    gradients for those steps (torch's DDP hook leaves a joined rank's grads stale).
    """
    epochs, num_inputs = 2, 2 + rank
    base = make_model()
    model = copy.deepcopy(base)
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    grads, params = [], []
    with ddp.join():
        for _ in range(epochs):
            for i in range(num_inputs):
                train_step(ddp, opt, batch(rank, i))
                grads.append([p.grad.detach().clone() for p in model.parameters()])
                params.append([p.detach().clone() for p in model.parameters()])
    box = [(grads, params)]
    dist.broadcast_object_list(box, src=world_size - 1)
    grads, params = box[0]

    model = copy.deepcopy(base)
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                   parameters_as_bucket_view=bucket_view, lr=0.01)
    # Iterations run after this rank has joined; their gradients are the ground truth's.
    after = epochs * (world_size - 1 - rank)
    setter = _GradSetter(list(model.parameters()), grads[len(grads) - after:])
    it = 0
    with Join([ddp, setter, zero]):
        for _ in range(epochs):
            for i in range(num_inputs):
                Join.notify_join_context(setter)
                train_step(ddp, zero, batch(rank, i))
                for (name, p), q in zip(model.named_parameters(), params[it]):
                    torch.testing.assert_close(p.detach(), q, rtol=RTOL, atol=ATOL, msg=f"iteration {it}: {name}")
                it += 1
    for (name, p), q in zip(model.named_parameters(), params[-1]):
        torch.testing.assert_close(p.detach(), q, rtol=RTOL, atol=ATOL, msg=f"after Join: {name}")
    assert setter.index == after, (setter.index, after)


def _table() -> dict:
    cases = {}
    for optim in OPTIMIZERS:
        for maximize in (False, True):
            for bucket_view in (False, True):
                cases[f"parity-{optim}-max{int(maximize)}-bv{int(bucket_view)}"] = functools.partial(
                    parity, optim=optim, maximize=maximize, bucket_view=bucket_view)
        cases[f"parity-{optim}-two_groups"] = functools.partial(parity, optim=optim, two_groups=True)
        cases[f"parity-{optim}-two_groups-bv1"] = functools.partial(parity, optim=optim, two_groups=True,
                                                                    bucket_view=True)
    for bucket_view in (False, True):
        cases[f"parity-adam-flip_requires_grad-bv{int(bucket_view)}"] = functools.partial(
            parity, optim="adam", flip=True, bucket_view=bucket_view, steps=5)
        cases[f"failed_step-bv{int(bucket_view)}"] = functools.partial(failed_step, bucket_view=bucket_view)
        cases[f"add_param_group-bv{int(bucket_view)}"] = functools.partial(add_param_group, bucket_view=bucket_view)
        cases[f"lr_scheduler-bv{int(bucket_view)}"] = functools.partial(lr_scheduler, bucket_view=bucket_view)
        for optim in OPTIMIZERS:
            cases[f"state_dict-{optim}-bv{int(bucket_view)}"] = functools.partial(
                state_dict_exchange, optim=optim, bucket_view=bucket_view)
        cases[f"subgroup-bv{int(bucket_view)}"] = functools.partial(subgroup, bucket_view=bucket_view)
        cases[f"join_vs_torch-bv{int(bucket_view)}"] = functools.partial(join_uneven_vs_torch, bucket_view=bucket_view)
        cases[f"join_ground_truth-bv{int(bucket_view)}"] = functools.partial(
            join_uneven_ground_truth, bucket_view=bucket_view)
    cases["state_dict-adam-maximize"] = functools.partial(state_dict_exchange, optim="adam", bucket_view=False,
                                                          maximize=True)
    cases["parity-sgd_momentum-closure"] = functools.partial(parity, optim="sgd_momentum", closure=True)
    cases["ownership"] = ownership
    cases["torch_attributes"] = torch_attributes
    cases["ranks_disagree"] = ranks_disagree
    cases["step_kwargs"] = step_kwargs
    return cases


CASES = _table()
