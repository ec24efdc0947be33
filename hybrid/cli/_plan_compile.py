"""``python -m hybrid plan --compile``: the pieces ``torch.compile(hybrid DDP)`` cuts a model's graph into.

The graph is captured by dynamo on one CPU example input and split by hybrid's SplitBackend,
beside the buckets the reducer rebuilds from the graphs' order. torch is imported only here.
"""

from __future__ import annotations

import importlib

from hybrid.core import plan_buckets


def torch_module(module: str | None, model: str | None):
    """The torch module behind ``--module PKG.MOD:FACTORY`` or ``--model mlp``, the one built-in
    example with a torch twin (``hybrid.models.TorchMLP`` of the example's names and sizes)."""
    if module is not None:
        module_name, _, factory_name = module.partition(":")
        return getattr(importlib.import_module(module_name), factory_name)()
    if model != "mlp":
        raise SystemExit("hybrid plan: --compile traces a torch module: give --module PKG.MOD:FACTORY or --model mlp")
    from hybrid.models import TorchMLP

    return TorchMLP((2048,) * 7)  # hybrid.models.EXAMPLES["mlp"]: 6 Linear(2048, 2048), layers.{i}.weight / .bias


def _example_input(module, shape: str | None):
    import torch
    first = next((m for m in module.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if shape is not None:
        try:
            dims = tuple(int(d) for d in shape.split(","))
        except ValueError:
            raise SystemExit(f"hybrid plan: --input-shape wants N,D,... integers, got {shape!r}")
        if isinstance(first, torch.nn.Embedding):
            return torch.zeros(dims, dtype=torch.long)
        return torch.randn(dims)
    if isinstance(first, torch.nn.Linear):
        return torch.randn(2, first.in_features)
    if isinstance(first, torch.nn.Conv2d):
        return torch.randn(2, first.in_channels, 32, 32)
    if isinstance(first, torch.nn.Embedding):
        return torch.zeros(2, 16, dtype=torch.long)
    raise SystemExit(f"hybrid plan: cannot build an example input from the first layer "
                     f"({type(first).__name__}); give --input-shape")


def compile_report(module, specs, size_limits, input_shape: str | None = None) -> dict:
    """What ``torch.compile(hybrid DDP)`` does with the model: one entry per captured graph.

    The graph is captured by dynamo on one CPU example input, planned by the same SplitBackend
    (compiling the pieces with the ``eager`` backend); the buckets are the reducer's rebuild from
    the graphs' reverse-use order (the last graph's parameters first), with the same limits.
    """
    import torch

    from hybrid.core import rebuild_plan
    from hybrid.torch import SplitBackend
    from hybrid.torch.ddp._parts import _reduced_parameters
    x = _example_input(module, input_shape)
    named = _reduced_parameters(module, set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())))
    orders = []
    split = SplitBackend("eager", params=named, size_limits=size_limits,
                         on_plan=lambda report, ordered: orders.append(ordered))
    torch._dynamo.reset()
    torch.compile(module, backend=split)(x)
    index = {id(p): i for i, (_, p) in enumerate(named)}
    ready = [index[id(p)] for ordered in reversed(orders) for p in ordered]
    buckets = rebuild_plan(plan_buckets(specs, size_limits=size_limits), ready, size_limits=size_limits)
    graphs = []
    for report in split.reports:
        plan = report.plan
        graphs.append({"pieces": [{"bytes": plan.nbytes(k), "nodes": report.nodes[k],
                                   "params": [plan.specs[i].name for i in plan.members(k)]}
                                  for k in range(plan.num_pieces)],
                       "compiled_whole": report.reason, "merged_groups": list(plan.merged),
                       "table": report.table(buckets)})
    return {"input_shape": list(x.shape), "size_limits": list(size_limits), "graphs": graphs,
            "buckets": [[specs[m].name for m in b.members] for b in buckets.buckets]}


def print_compile(view: dict) -> None:
    print(f"\ntorch.compile(hybrid DDP) on one input of shape {tuple(view['input_shape'])}: "
          f"{len(view['graphs'])} graph(s); pieces in gradient-ready order, each compiled apart; (bucket): "
          f"the parameter's bucket once the reducer rebuilds from the graph order (a bucket may close "
          f"inside a node, a piece only at a node's end)")
    for g, graph in enumerate(view["graphs"]):
        print(f"\ngraph {g}: {graph['table']}")
