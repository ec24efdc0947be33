"""torch.compile with graph splits at the bucket boundaries (dynamo's ``DDPOptimizer``, planned by core).

A compiled model's backward is one fused function: every gradient becomes ready at once and no
all-reduce overlaps it. :class:`SplitBackend` is a dynamo backend that cuts the captured FX graph
where :func:`hybrid.core.plan_graph_split` says, compiles each piece with the user's backend and
stitches them together, so the backward runs piece by piece and each piece's buckets are reduced
while the earlier pieces' backward still runs.

Two ways in:

* ``torch.compile(hybrid_ddp)``: hybrid's ``DistributedDataParallel.forward`` runs its module
  through :func:`forward_module`, a frame dynamo skips (as torch's ``_inside_ddp_forward``). When a
  dynamo callback is active there and ``torch._dynamo.config.optimize_ddp`` asks for the
  ``ddp_optimizer`` mode, the module runs through ``torch.compile(f, backend=SplitBackend(the
  active backend))`` instead, ``f`` calling the module (see :func:`_own_code`), with the reducer's
  rebuild caps: the mechanism torch uses for its own class (``convert_frame`` swapping in
  ``DDPOptimizer`` while ``_get_active_ddp_module()`` is set), without registering hybrid's class
  with torch's. With ``optimize_ddp`` off, ``f`` is traced whole by the outer call's callback.
* :func:`compile`: explicit backend and split caps, for a hybrid DDP or a plain module.

Limits: the inner compile sees only the backend of the outer ``torch.compile`` call (``mode`` and
``options`` travel inside inductor's backend object; ``fullgraph`` and ``dynamic`` do not).
"""

from __future__ import annotations

import dataclasses
import logging
import types
import weakref
from collections.abc import Callable, Sequence

import torch
import torch._dynamo
from torch import fx, nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback

from hybrid.core import GraphSplitPlan, TensorSpec, canonical_dtype, merge_piece, plan_graph_split, split_size_limits
from hybrid.torch.ddp import DistributedDataParallel, _forward

log = logging.getLogger("hybrid.torch.compile")
_MB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class SplitReport:
    """What :class:`SplitBackend` did with one captured graph.

    ``plan`` is the split plan (pieces in gradient-ready order), ``nodes`` the number of graph nodes
    per piece, ``merged`` the pieces joined to a neighbour because they had no output, ``reason``
    why the graph was compiled whole (``None`` when it was split).
    """

    plan: GraphSplitPlan
    nodes: tuple[int, ...]
    reason: str | None

    @property
    def num_pieces(self) -> int:
        return self.plan.num_pieces if self.reason is None else 1

    def table(self, bucket_plan=None) -> str:
        """Pieces, their parameters and sizes, next to ``bucket_plan``'s buckets when given."""
        bucket_of = {}
        if bucket_plan is not None:
            names = [s.name for s in bucket_plan.specs]
            bucket_of = {names[m]: b for b, bk in enumerate(bucket_plan.buckets) for m in bk.members}
        lines = [f"{self.plan.num_pieces} piece(s), limits {list(self.plan.size_limits)} bytes"
                 + (f"; compiled whole: {self.reason}" if self.reason else "")
                 + (f"; merged at groups {list(self.plan.merged)} (a piece without outputs)" if self.plan.merged else "")]
        lines.append(f"{'piece':>5} {'bytes':>10} {'nodes':>6}  parameter{'  (bucket)' if bucket_plan else ''}")
        for k in range(self.plan.num_pieces):
            for j, i in enumerate(self.plan.members(k)):
                name = self.plan.specs[i].name
                head = f"{k:>5} {self.plan.nbytes(k):>10} {self.nodes[k]:>6}" if j == 0 else " " * 23
                lines.append(f"{head}  {name}" + (f"  ({bucket_of.get(name, '-')})" if bucket_plan else ""))
        return "\n".join(lines)


def _lookup(backend):
    if isinstance(backend, str):
        return torch._dynamo.lookup_backend(backend)
    if not callable(backend):
        raise TypeError(f"backend must be a name or a callable (gm, example_inputs), got {backend!r}")
    return backend


class SplitBackend:
    """A dynamo backend: split the graph at the plan's boundaries, compile each piece with ``backend``.

    Args:
      backend: the user's backend, a name (``"inductor"``, ``"eager"``, ``"aot_eager"``) or a
        callable ``(gm, example_inputs) -> callable``.
      params: ``(name, parameter)`` pairs whose bytes count toward a piece (DDP's reduced
        parameters); others (ignored parameters, frozen ones, buffers) ride along uncounted.
      size_limits: byte limits of piece 0, 1, ... (see :func:`hybrid.core.split_size_limits`).
      on_plan: called with ``(report, ordered_parameters)`` after each graph is planned.

    ``reports`` holds one :class:`SplitReport` per compiled graph.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> split = SplitBackend("eager", params=list(model.named_parameters()), size_limits=(1,))
    >>> out = torch.compile(model, backend=split)(torch.ones(3, 4))
    >>> split.reports[-1].num_pieces
    2
    """

    def __init__(self, backend, *, params: Sequence[tuple[str, nn.Parameter]], size_limits: Sequence[int],
                 on_plan: Callable | None = None):
        self.backend = _lookup(backend)
        self._name_of = {id(p): (n, p) for n, p in params}
        self.size_limits = tuple(size_limits)
        self.on_plan = on_plan
        self.reports: list[SplitReport] = []

    # ---- planning -------------------------------------------------------------------------

    def _params_of(self, gm: fx.GraphModule, node: fx.Node) -> list[nn.Parameter]:
        found = []
        for arg in node.all_input_nodes:
            value = None
            if arg.op == "placeholder":
                # dynamo's GraphArg holds the real tensor (example_value is fake when the
                # parameter is lifted to an input, as with inline_inbuilt_nn_modules)
                grapharg = arg.meta.get("grapharg")
                value = grapharg.example if grapharg is not None else arg.meta.get("example_value")
            elif arg.op == "get_attr":
                value = getattr(gm, str(arg.target), None)
            if isinstance(value, nn.Parameter) and id(value) in self._name_of:
                found.append(value)
        if node.op == "call_module":
            found += [p for p in gm.get_submodule(str(node.target)).parameters() if id(p) in self._name_of]
        return found

    def plan(self, gm: fx.GraphModule) -> tuple[GraphSplitPlan, dict, list[nn.Parameter]]:
        """The split plan of ``gm``, each node's piece, and the counted parameters in ready order."""
        seen, ordered, groups, marks = set(), [], [], []
        for node in reversed(gm.graph.nodes):
            if node.op in ("placeholder", "output"):
                continue
            new = []
            for p in self._params_of(gm, node):
                if id(p) not in seen:
                    seen.add(id(p))
                    new.append(len(ordered))
                    ordered.append(p)
            if new:
                groups.append(tuple(new))
                marks.append((node, len(groups) - 1))
            else:
                marks.append((node, len(groups)))  # joins the next parameter-using node (reverse order)
        specs = [TensorSpec(self._name_of[id(p)][0], tuple(p.shape), canonical_dtype(p.dtype), str(p.device))
                 for p in ordered]
        plan = plan_graph_split(specs, groups, size_limits=self.size_limits)
        while True:
            piece = _piece_map(plan, marks)
            empty = _first_piece_without_output(plan, piece)
            if empty is None:
                return plan, piece, ordered
            plan = merge_piece(plan, empty)

    # ---- compiling ------------------------------------------------------------------------

    def __call__(self, gm: fx.GraphModule, example_inputs, **kwargs):
        plan, piece, ordered = self.plan(gm)
        nodes = tuple(sum(1 for k in piece.values() if k == j) for j in range(max(plan.num_pieces, 1)))
        reason = None
        hop = next((n.target for n in gm.graph.nodes if n.op == "get_attr"
                    and isinstance(getattr(gm, str(n.target), None), fx.GraphModule)), None)
        if plan.num_pieces == 0:
            reason = "the graph uses no parameter that is reduced"
        elif plan.num_pieces == 1:
            reason = "all of its parameters fit in one piece"
        elif hop is not None:
            reason = (f"it holds a higher-order op (its body {hop!r}); splitting around higher-order ops is "
                      "not supported, so gradients of this graph become ready together")
        report = SplitReport(plan, nodes, reason)
        self.reports.append(report)
        if plan.merged:
            log.warning("hybrid.torch.compile merged %d piece(s) that would have had no outputs "
                        "(in-place only), at groups %s", len(plan.merged), list(plan.merged))
        if reason is not None and hop is not None and plan.num_pieces > 1:
            log.warning("hybrid.torch.compile: graph compiled whole: %s", reason)
        log.info("hybrid.torch.compile split:\n%s", report.table())
        if self.on_plan is not None:
            self.on_plan(report, ordered)
        if reason is not None:
            return self.backend(gm, example_inputs, **kwargs)
        return self._compile_split(gm, example_inputs, plan, piece, **kwargs)

    def _compile_split(self, gm, example_inputs, plan, piece, **kwargs):
        # Partition ids in forward order: submod_0 runs first, holds the last piece of the backward.
        last = plan.num_pieces - 1
        split_gm = fx.passes.split_module.split_module(gm, None, lambda n: last - piece[n])
        # Compiling each piece on fake inputs and stitching is torch's own machinery (the part of
        # DDPOptimizer that does not plan): its SubmodCompiler keeps aot_autograd's per-piece
        # metadata and output strides consistent across pieces.
        from torch._dynamo.backends.distributed import SubmodCompiler, propagate_dynamo_source, propagate_metadata
        from torch._dynamo.utils import detect_fake_mode
        propagate_dynamo_source(gm, split_gm)
        propagate_metadata(gm, split_gm)
        fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.fake_tensor.FakeTensorMode()
        compiler = SubmodCompiler(split_gm, self.backend, fake_mode, **kwargs)
        with torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing():
            compiler.run(*example_inputs)
        split_gm.recompile()
        return split_gm


def _piece_map(plan: GraphSplitPlan, marks) -> dict:
    owner = plan.piece_of_group()
    if not owner:
        return {node: 0 for node, _ in marks}
    return {node: owner[min(g, len(owner) - 1)] for node, g in marks}


def _first_piece_without_output(plan: GraphSplitPlan, piece: dict) -> int | None:
    """A piece none of whose nodes is used outside it: fx cannot cut the graph there."""
    if plan.num_pieces <= 1:
        return None
    has_output = [False] * plan.num_pieces
    for node, k in piece.items():
        # get_attr nodes are copied into every piece that uses them: they are no piece's output
        if node.op != "get_attr" and not has_output[k] and any(u.op == "output" or piece.get(u, k) != k for u in node.users):
            has_output[k] = True
    return next((k for k, ok in enumerate(has_output) if not ok), None)


# ---- torch.compile(hybrid_ddp) --------------------------------------------------------------

@dataclasses.dataclass
class _DDPCompileState:
    size_limits: tuple[int, ...] | None = None   # None: the reducer's rebuild limits
    force: bool = False                          # hybrid.torch.compile: split whatever optimize_ddp says
    # (id(backend), split?) -> (backend, SplitBackend or None, callable(module, inputs, kwargs))
    compiled: dict = dataclasses.field(default_factory=dict)


_STATE: "weakref.WeakKeyDictionary[nn.Module, _DDPCompileState]" = weakref.WeakKeyDictionary()
_PLAIN: "weakref.WeakKeyDictionary[nn.Module, SplitBackend]" = weakref.WeakKeyDictionary()  # compile()'s result


def _forward_module(ddp, inputs, kwargs):
    callback = get_eval_frame_callback()
    if callback is None or callback is False:
        return ddp.module(*inputs, **kwargs)   # eager, or dynamo's run-only mode
    return _entry(ddp, callback)(ddp.module, inputs, kwargs)


@torch._dynamo.disable
def _entry(ddp, callback):
    """The callable that runs ``ddp.module`` under ``callback``, built on the first call.

    Run with dynamo's callback off: called from :func:`forward_module`'s skipped frame, every
    Python frame below it (this lookup, ``SplitBackend``'s construction, the ~40 frames of os,
    inspect and pathlib that ``torch.compile(...)`` runs to build the inner compile) would be a
    frame of its own for the outer callback, each converted once and found to hold no tensor
    work: 53 frames in the first step of a 3-layer model instead of the 4 that trace it.
    """
    from torch._dynamo.eval_frame import innermost_backend
    from torch._dynamo.utils import get_optimize_ddp_mode
    state = _STATE.get(ddp)
    if state is None:
        state = _STATE.setdefault(ddp, _DDPCompileState())
    backend = innermost_backend(callback)
    split = state.force or get_optimize_ddp_mode() == "ddp_optimizer"
    entry = state.compiled.get((id(backend), split))
    if entry is None or entry[0] is not backend:
        if split:
            limits = state.size_limits or ddp._rebuild_limits
            splitter = SplitBackend(backend, params=list(zip(ddp._names, ddp._params)), size_limits=limits,
                                    on_plan=lambda report, ordered: _hint_ready_order(ddp, ordered))
            entry = (backend, splitter, torch.compile(_own_code(_call_module), backend=splitter))
        else:   # traced whole by the outer call's own callback, on this entry's own code
            entry = (backend, None, _own_code(_call_module))
        state.compiled[(id(backend), split)] = entry
    return entry[2]


def _call_module(module, inputs, kwargs):
    return module(*inputs, **kwargs)


def _own_code(fn):
    """``fn`` on a code object of its own: the frame through which dynamo traces the module.

    Called from :func:`forward_module`'s skipped frame, ``ddp.module(...)`` of a ``torch.nn``
    class (a bare ``nn.Sequential``) would run eagerly: dynamo skips top-level frames in
    ``torch.nn``, and would inline them from a frame of ours (``OptimizedModule`` uses
    ``wrap_inline`` so). Its own code per entry keeps each entry's cache entries (and dynamo's
    per-code recompile limit) apart from every other compile of the same class.
    """
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


# dynamo skips this frame (not the frames it calls), as torch's _inside_ddp_forward: a traced
# caller graph-breaks at the call (``_torchdynamo_disable``) and the frame's code is marked skipped
# once. torch.compiler.disable(recursive=False) would not do: it skips the frame
# with apply_to_code=False, so dynamo's callback (and counters["frames"]["total"]) is entered on
# every call, which reads as one compile per step (torch 2.13).
forward_module = torch._dynamo.decorators.skip(_forward_module)
_forward.install(forward_module)


def _hint_ready_order(ddp, ordered: list[nn.Parameter]) -> None:
    """Give the reducer the graph's reverse-use order for its one rebuild, so that with equal caps
    its buckets are the graph's pieces (pieces snap to node ends: a node's parameters stay together).
    Only for a graph that uses every reduced parameter: with graph breaks each graph sees a part."""
    if len(ordered) == len(ddp._params):
        ddp._reducer.rebuild.hint(tuple(ddp._index_of[id(p)] for p in ordered))


def split_reports(model) -> list[SplitReport]:
    """The :class:`SplitReport` of every graph compiled with splits for ``model``.

    ``model`` is a hybrid ``DistributedDataParallel`` (compiled with ``torch.compile`` or
    :func:`compile`) or what :func:`compile` returned for a plain module.

    >>> split_reports(torch.nn.Linear(2, 2))
    []
    """
    if model in _PLAIN:
        return list(_PLAIN[model].reports)
    inner = getattr(model, "_orig_mod", model)
    state = _STATE.get(inner)
    return [r for _, split, _ in (state.compiled.values() if state else ()) if split for r in split.reports]


def compile(model: nn.Module, *, backend="inductor", split_cap_mb: float | None = None,
            first_split_cap_mb: float | None = None, **compile_kwargs) -> nn.Module:
    """``torch.compile`` with the graph cut into separately compiled pieces of ``split_cap_mb``.

    For a hybrid ``DistributedDataParallel`` the caps default to its reducer's (so the pieces are
    its buckets) and the split happens whatever ``torch._dynamo.config.optimize_ddp`` says; for a
    plain module every parameter that requires a gradient counts and the caps default to DDP's
    (1 MiB, then 25 MiB). ``split_cap_mb`` may be below 1 MiB (torch's ``DDPOptimizer`` asserts).

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> compiled = compile(model, backend="eager", split_cap_mb=0)
    >>> compiled(torch.ones(3, 4)).shape, split_reports(compiled)[0].num_pieces
    (torch.Size([3, 2]), 2)
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("hybrid.torch.compile splits graphs for hybrid.torch.DistributedDataParallel or a "
                        "plain module; torch's own DistributedDataParallel gets DDPOptimizer from torch.compile")
    limits = None
    if split_cap_mb is not None or first_split_cap_mb is not None:
        limits = split_size_limits(None if split_cap_mb is None else int(split_cap_mb * _MB),
                                   None if first_split_cap_mb is None else int(first_split_cap_mb * _MB))
    if isinstance(model, DistributedDataParallel):
        _STATE[model] = _DDPCompileState(size_limits=limits, force=True)
        return torch.compile(model, backend=backend, **compile_kwargs)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    split = SplitBackend(backend, params=params, size_limits=limits or split_size_limits())
    compiled = torch.compile(model, backend=split, **compile_kwargs)
    _PLAIN[compiled] = split
    return compiled
