"""``python -m hybrid plan``: the bucket table and the ZeRO view of a model.

Sources: a built-in example (``--model``), a torch module factory (``--module pkg.mod:factory``)
or a JSON list of specs (``--specs FILE``). ``--json`` prints one JSON object instead of tables.
``--compile`` traces a torch module with dynamo and prints the pieces ``torch.compile(hybrid DDP)``
cuts its graph(s) into, next to the buckets the reducer rebuilds from the graph's order.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from hybrid import _plan_pair, _project_cli
from hybrid._examples import EXAMPLES
from hybrid._table import format_table, human_bytes
from hybrid.core import (DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES, MiB, OPTIMIZER_STATE_COPIES, STAGES,
                         TensorSpec, forward_order, itemsize, partition_params, plan_buckets, shard_flat, step_cost,
                         zero3_memory, zero3_plan, zero_memory)
from hybrid.core._spec import check_specs, specs_from_json


LEGEND = """\
What the words mean:
  plan <fingerprint>  a hash of the bucket plan (names, shapes, dtypes, buckets, offsets); ranks, and the
                      torch and JAX frontends, build the same plan exactly when their fingerprints match
  limit               the byte cap the bucket was filled up to; torch's DDP closes a bucket once its bytes
                      reach it. A first-bucket cap at or above --bucket-cap-mb is ignored, as in torch
  owned (greedy)      ZeRO-1 (torch's ZeroRedundancyOptimizer): whole tensors per rank, largest first to
                      the least-loaded rank
  imbalance           a rank's owned bytes against an even split (total / world size)
  flat shard          ZeRO-2: every bucket cut in world-size equal slices (padded); the same on every rank
  ZeRO-1/2 state      optimizer-state bytes a rank keeps; "total" adds parameters and gradients
  ZeRO-3              parameters, gradients and optimizer state all as the rank's flat slices; "gathered":
                      the full buckets held at once during a step, the bucket computing and --prefetch
                      more (their all-gathers overlap its compute) and, in the backward, the full
                      gradient being reduce-scattered; "kept" holds the forward's buckets for the
                      backward instead of gathering them again (FSDP's reshard_after_forward=False)
  forward order       the buckets in the order the forward first uses them (the plan's reverse)
  sent per step       bytes each rank sends per step over ring collectives: DDP one all-reduce per bucket,
                      ZeRO-1 (torch) all-reduce + broadcast of the shares, ZeRO-2 reduce-scatter +
                      all-gather, ZeRO-3 an all-gather in the forward and in the backward + reduce-scatter
  paper formulas      bytes per rank by the ZeRO paper (Rajbhandari et al. 2020, sec. 5), with W the
                      parameter bytes (gradients as many), K optimizer-state bytes per parameter, P
                      parameters, N ranks: DDP W + W + K P, ZeRO-1 W + W + K P / N, ZeRO-2 W + W / N + K P / N,
                      ZeRO-3 (W + W + K P) / N (without the gathered working set)"""

NEXT = """\
Next: python -m hybrid demo trains one model with both frontends; examples/torch_train.py (launch with
torchrun) and examples/jax_train.py (jax.distributed) are training scripts to start from."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="print the bucket plan and ZeRO view of a model",
                       description="Print the DDP bucket table and per-rank ZeRO view of a model.",
                       epilog=LEGEND + "\n\n" + NEXT, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", choices=sorted(EXAMPLES), help="a built-in example (default: gpt2-small)")
    source.add_argument("--module", metavar="PKG.MOD:FACTORY",
                        help="a torch module: FACTORY() is called and its trainable parameters planned")
    source.add_argument("--specs", metavar="FILE", type=Path,
                        help='JSON list of specs: [{"name": .., "shape": [..], "dtype": "float32"}, ..]')
    _plan_pair.add_arguments(p, source)
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket cap in MiB, as torch's bucket_cap_mb: left out, 25 with a 1 MiB first bucket; "
                        "given, it caps the first bucket too (torch's rule)")
    p.add_argument("--first-bucket-cap-mb", type=float, default=None,
                   help="cap of the first bucket in MiB (default: torch's, 1 MiB, or --bucket-cap-mb when given)")
    p.add_argument("--world-size", type=int, default=4, help="number of data-parallel ranks for the ZeRO view")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_COPIES), default="adam")
    p.add_argument("--prefetch", type=int, default=1,
                   help="ZeRO-3: buckets gathered ahead of the one computing (default 1)")
    p.add_argument("--master-weights", action="store_true",
                   help="count fp32 master weights in optimizer state (mixed-precision training)")
    p.add_argument("--compile", action="store_true",
                   help="trace the model with dynamo (torch) and list the pieces torch.compile(hybrid DDP) "
                        "splits its graph into, next to the reducer's buckets; --module or --model mlp")
    p.add_argument("--input-shape", metavar="N,D,...",
                   help="with --compile: shape of the one example input (float32; int64 for an Embedding "
                        "first); default from the first layer: Linear (2, in), Conv2d (2, in, 32, 32), "
                        "Embedding (2, 16)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _project_cli.add_arguments(p)
    return p


def load_specs(args) -> tuple[str, tuple[TensorSpec, ...]]:
    """The specs named by the command line, and a label for them."""
    if args.specs is not None:
        try:
            data = json.loads(args.specs.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"hybrid plan: cannot read specs from {args.specs}: {e}")
        items = data["specs"] if isinstance(data, dict) else data
        try:
            return str(args.specs), specs_from_json(items)
        except (KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"hybrid plan: bad spec in {args.specs}: {e!r}")
    if args.module is not None:
        return args.module, specs_of_module(args.module)
    name = args.model or "gpt2-small"
    return name, check_specs(EXAMPLES[name]())


def specs_of_module(target: str) -> tuple[TensorSpec, ...]:
    """TensorSpecs of the trainable parameters of ``FACTORY()`` for ``"pkg.mod:FACTORY"``."""
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise SystemExit(f"hybrid plan: --module wants PKG.MOD:FACTORY, got {target!r}")
    sys.path.insert(0, "")  # like `python -m`, let modules in the working directory be found
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"hybrid plan: cannot load {target!r}: {e}")
    from hybrid.torch import specs as torch_specs  # torch is needed only for this source

    return torch_specs(factory())


def _torch_module(args):
    """The torch module behind ``--module`` or ``--model mlp`` (the only built-in with a torch twin)."""
    if args.module is not None:
        module_name, _, factory_name = args.module.partition(":")
        return getattr(importlib.import_module(module_name), factory_name)()
    if (args.model or "gpt2-small") != "mlp" or args.specs is not None:
        raise SystemExit("hybrid plan: --compile traces a torch module: give --module PKG.MOD:FACTORY or --model mlp")
    import torch

    class MLP(torch.nn.Module):  # the names of hybrid._examples.mlp: layers.{i}.weight / .bias
        def __init__(self, width=2048, depth=6):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x
    return MLP()


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


def compile_report(args, specs, size_limits) -> dict:
    """What ``torch.compile(hybrid DDP)`` does with the model: one entry per captured graph.

    The graph is captured by dynamo on one CPU example input, planned by the same SplitBackend
    (compiling the pieces with the ``eager`` backend); the buckets are the reducer's rebuild from
    the graphs' reverse-use order (the last graph's parameters first), with the same limits.
    """
    module = _torch_module(args)
    import torch

    from hybrid.core import rebuild_plan
    from hybrid.torch import SplitBackend
    from hybrid.torch.ddp._parts import _reduced_parameters
    x = _example_input(module, args.input_shape)
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


def resolve_caps(args) -> None:
    """The caps as torch's DDP takes ``bucket_cap_mb``: left out, 25 MiB with a 1 MiB first bucket;
    given, the first bucket gets it too (torch's ``_BucketCapacityConfig.create``). What was given
    stays in ``bucket_cap_mb_given`` (None: the default), for running torch's DDP as built at these flags."""
    args.bucket_cap_mb_given = args.bucket_cap_mb
    if args.bucket_cap_mb is None:
        args.bucket_cap_mb = DEFAULT_BUCKET_CAP_BYTES / MiB
    if args.first_bucket_cap_mb is None:
        given = args.bucket_cap_mb_given
        args.first_bucket_cap_mb = DEFAULT_FIRST_BUCKET_CAP_BYTES / MiB if given is None else given


def check_caps(args) -> None:
    for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
        if getattr(args, name) < 0:
            raise SystemExit(f"hybrid plan: --{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")


def build_report(label: str, specs, args, plan=None) -> dict:
    """The report of ``specs`` at the command line's caps (``plan``: one planned already, e.g. in a
    gradient-ready order)."""
    check_caps(args)
    if args.world_size < 1:
        raise SystemExit(f"hybrid plan: --world-size must be >= 1, got {args.world_size}")
    if args.prefetch < 0:
        raise SystemExit(f"hybrid plan: --prefetch must be >= 0, got {args.prefetch}")
    if plan is None:
        plan = plan_buckets(specs, bucket_cap_bytes=int(args.bucket_cap_mb * MiB),
                            first_bucket_cap_bytes=int(args.first_bucket_cap_mb * MiB))
    partition = partition_params(specs, args.world_size)
    shards = shard_flat(plan, args.world_size)
    memory = zero_memory(specs, args.world_size, args.optimizer, master_weights=args.master_weights)
    k = memory.state_bytes_per_param
    owned = partition.numel_per_rank()
    owned_bytes = partition.bytes_per_rank()
    ideal = sum(s.nbytes for s in specs) / args.world_size
    # Every rank's flat shard has the same size: one equal slice of each bucket.
    flat_shard_bytes = sum(size * itemsize(b.dtype) for size, b in zip(shards.shard_sizes, plan.buckets))
    ranks = []
    for r in range(args.world_size):
        ranks.append({
            "rank": r, "params_owned": owned[r], "bytes_owned": owned_bytes[r],
            "imbalance_vs_ideal": owned_bytes[r] / ideal - 1 if ideal else 0.0,
            "flat_shard_bytes": flat_shard_bytes,
            "zero1_state_bytes": k * owned[r],
            "zero1_total_bytes": memory.param_bytes + memory.grad_bytes + k * owned[r],
            "zero2_state_bytes": k * sum(shards.shard_sizes),
            "zero2_total_bytes": memory.param_bytes + flat_shard_bytes + k * sum(shards.shard_sizes),
        })
    buckets = [{
        "index": i, "dtype": b.dtype, "device": b.device, "tensors": len(b.members),
        "bytes": b.nbytes, "size_limit": b.size_limit,
        "first": specs[b.members[0]].name, "last": specs[b.members[-1]].name,
    } for i, b in enumerate(plan.buckets)]
    return {
        "source": label, "num_tensors": len(specs), "num_params": memory.num_params,
        "param_bytes": memory.param_bytes, "fingerprint": plan.fingerprint(),
        "bucket_cap_bytes": int(args.bucket_cap_mb * MiB), "first_bucket_cap_bytes": int(args.first_bucket_cap_mb * MiB),
        "size_limits": list(plan.size_limits),
        "buckets": buckets, "world_size": args.world_size, "optimizer": args.optimizer,
        "state_bytes_per_param": k,
        "formula_bytes_per_rank": {"ddp": memory.ddp, "zero1": memory.zero1, "zero2": memory.zero2,
                                   "zero3": memory.zero3},
        "ranks": ranks, **zero3_report(plan, shards, k, args.prefetch),
    }


def zero3_report(plan, shards, k: int, prefetch: int) -> dict:
    """Stage 3's bytes per rank (every rank alike) and each stage's bytes sent per rank per step."""
    def memory(reshard):
        m = zero3_memory(shards, k, prefetch=prefetch, reshard_after_forward=reshard)
        return {"param_bytes": m.param_bytes, "grad_bytes": m.grad_bytes, "state_bytes": m.state_bytes,
                "gathered_bytes": m.gathered_bytes, "total_bytes": m.total}

    def sent(stage, reshard=True):  # bytes only: the collectives' time does not matter here
        return step_cost(plan, shards.world_size, stage, lambda kind, n: 0.0, forward_s=0.0, backward_s=0.0,
                         reshard_after_forward=reshard, prefetch=prefetch).wire_bytes

    volume = {stage if stage == "ddp" else f"zero{stage}": sent(stage) for stage in STAGES}
    return {"prefetch": prefetch, "forward_order": list(forward_order(plan)),
            "zero3_fingerprint": zero3_plan(plan.specs).fingerprint(),
            "zero3_bytes_per_rank": memory(True), "zero3_kept_bytes_per_rank": memory(False),
            "sent_bytes_per_rank_per_step": {**volume, "zero3_kept": sent(3, reshard=False)}}


def print_report(report: dict) -> None:
    print(f"{report['source']}: {report['num_tensors']} tensors, {report['num_params']:,} parameters, "
          f"{human_bytes(report['param_bytes'])}; plan {report['fingerprint']}")
    print(f"\nBuckets (reduced in this order; {_caps_used(report)}):")
    print(format_table(["#", "dtype", "device", "tensors", "bytes", "limit", "first tensor", "last tensor"],
                       [[b["index"], b["dtype"], b["device"], b["tensors"], human_bytes(b["bytes"]),
                         human_bytes(b["size_limit"]), b["first"], b["last"]] for b in report["buckets"]]))
    f = report["formula_bytes_per_rank"]
    print(f"\nZeRO view, world size {report['world_size']}, {report['optimizer']} "
          f"({report['state_bytes_per_param']} B of optimizer state per parameter):")
    print(format_table(["rank", "owned (greedy)", "imbalance", "flat shard", "ZeRO-1 state", "ZeRO-1 total", "ZeRO-2 state",
                        "ZeRO-2 total"],
                       [[r["rank"], human_bytes(r["bytes_owned"]), f"{100 * r['imbalance_vs_ideal']:+.2f}%",
                         human_bytes(r["flat_shard_bytes"]), human_bytes(r["zero1_state_bytes"]),
                         human_bytes(r["zero1_total_bytes"]), human_bytes(r["zero2_state_bytes"]),
                         human_bytes(r["zero2_total_bytes"])] for r in report["ranks"]]))
    z3, kept = report["zero3_bytes_per_rank"], report["zero3_kept_bytes_per_rank"]
    print(f"\nZeRO-3 per rank (every rank alike), prefetch {report['prefetch']}; forward order of the buckets: "
          f"{_order_text(report['forward_order'])}; of the plan above (ZeRO3's own plan at its default cap, what "
          f"parity --stage 3 reports: plan {report['zero3_fingerprint']}):")
    print(format_table(["ZeRO-3", "param slices", "grad slices", "state", "gathered", "total"],
                       [[name, *(human_bytes(m[key]) for key in ("param_bytes", "grad_bytes", "state_bytes",
                                                                  "gathered_bytes", "total_bytes"))]
                        for name, m in (("regathered in the backward", z3), ("kept for the backward", kept))]))
    sent = report["sent_bytes_per_rank_per_step"]
    print("\nSent per rank per step (ring collectives), and against DDP:")
    names = {"ddp": "DDP", "zero1": "ZeRO-1 (torch)", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "zero3_kept": "ZeRO-3 kept"}
    print(format_table(list(names.values()), [[human_bytes(sent[k]) for k in names],
                                              [f"{sent[k] / sent['ddp']:.2f}x" if sent["ddp"] else "-" for k in names]]))
    print(f"\nPaper formulas per rank: DDP {human_bytes(f['ddp'])}, ZeRO-1 {human_bytes(f['zero1'])}, "
          f"ZeRO-2 {human_bytes(f['zero2'])}, ZeRO-3 {human_bytes(f['zero3'])}")
    if "pairing" in report:
        _plan_pair.print_pairing(report["pairing"])
    if "compile" in report:
        print_compile(report["compile"])
    print(f"\n{LEGEND}\n\n{NEXT}")


def _order_text(order: list[int]) -> str:
    return " ".join(map(str, order)) if len(order) <= 12 else f"{' '.join(map(str, order[:12]))} ... ({len(order)})"


def _caps_used(report: dict) -> str:
    """The caps the plan was built with, in words (a first cap not below the cap is dropped, as in torch)."""
    limits = report["size_limits"]
    if len(limits) == 1:
        dropped = ""
        if report["first_bucket_cap_bytes"] != report["bucket_cap_bytes"]:
            dropped = (f"; the first-bucket cap {human_bytes(report['first_bucket_cap_bytes'])} is not below it, "
                       "so it is ignored, as in torch")
        return f"cap {human_bytes(limits[0])} for every bucket{dropped}"
    return f"caps {human_bytes(limits[0])} for the first bucket of each dtype and device, then {human_bytes(limits[1])}"


def print_compile(view: dict) -> None:
    print(f"\ntorch.compile(hybrid DDP) on one input of shape {tuple(view['input_shape'])}: "
          f"{len(view['graphs'])} graph(s); pieces in gradient-ready order, each compiled apart; (bucket): "
          f"the parameter's bucket once the reducer rebuilds from the graph order (a bucket may close "
          f"inside a node, a piece only at a node's end)")
    for g, graph in enumerate(view["graphs"]):
        print(f"\ngraph {g}: {graph['table']}")


def run(args) -> int:
    _plan_pair.check_arguments(args)
    resolve_caps(args)
    if args.jax is not None:
        check_caps(args)  # before the JAX half is traced
        label, plan, pairing = _plan_pair.pair_plan(args)
        specs = plan.specs
        report = build_report(label, specs, args, plan=plan)
        report["pairing"] = pairing
    else:
        label, specs = load_specs(args)
        report = build_report(label, specs, args)
    if args.compile:
        report["compile"] = compile_report(args, specs, tuple(report["size_limits"]))
    if args.project:
        report["projection"] = _project_cli.projection_report(specs, args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
        if args.project:
            _project_cli.print_projection(report["projection"])
    return 0
