"""``python -m hybrid checkpoint info PATH | convert SRC DST --to dcp|orbax|hybrid``.

``info`` says what a checkpoint directory holds, whatever wrote it (hybrid, torch DCP, orbax):
the step, the optimizer and its param groups, the tensors, and what hybrid leaves out.
``convert`` writes it in another format (``hybrid.checkpoint.convert``): everything is read and
checked first, then written into a hidden sibling of DST that is renamed to DST once complete;
each stage is printed to stderr. Objects the conversion needs (a ``ParamMapping``, the
``(params, opt_state)`` an orbax checkpoint is laid out like) are named by reference
(``pkg.module:name``, importable from the current directory; a function is called). See
docs/checkpoints-dcp-orbax.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from hybrid.checkpoint import FORMATS, CheckpointError, convert, detect_format, open_checkpoint


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("checkpoint", help="inspect a checkpoint, or convert between hybrid, torch DCP and orbax",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", required=True)
    info = actions.add_parser("info", help="what a checkpoint holds")
    info.add_argument("path")
    _source_options(info)
    info.add_argument("--json", action="store_true", help="print it as JSON")
    c = actions.add_parser("convert", help="write a checkpoint in another format")
    c.add_argument("src")
    c.add_argument("dst", help="where the new checkpoint goes (must not exist)")
    c.add_argument("--to", required=True, choices=FORMATS)
    _source_options(c)
    c.add_argument("--world-size", type=int, default=1, help="--to hybrid: how many rank files (default 1)")
    c.add_argument("--mapping", metavar="PKG.MOD:NAME",
                   help="a ParamMapping between a flax tree and torch's names (orbax <-> hybrid / dcp)")
    c.add_argument("--like", metavar="PKG.MOD:NAME",
                   help="--to orbax: (params, opt_state) to lay the tree out like (default: the checkpoint's names)")
    c.add_argument("--param-groups", metavar="FILE.json",
                   help="--to dcp: torch's param groups (a JSON list of dicts, parameters by name under "
                        "'params'), for a checkpoint that records none")
    return p


def _source_options(p) -> None:
    p.add_argument("--from", dest="source_format", choices=FORMATS, help="insist on the source's format")
    p.add_argument("--step", type=int, help="the step of an orbax CheckpointManager directory, or the training "
                                            "step of a checkpoint that records none")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3),
                   help="orbax: the ZeRO stage that saved hybrid.jax.zero's state, where the save holds no plan_tag "
                        "and the bucket plans of stages 1-2 and 3 both fit it")


def _object(reference: str):
    module, _, name = reference.partition(":")
    obj = getattr(importlib.import_module(module), name)
    return obj() if callable(obj) else obj


def describe(ckpt) -> dict:
    """What ``info`` prints: the checkpoint in plain data."""
    m = ckpt.manifest
    opt = m.optimizer
    return {"path": str(ckpt.path), "format": ckpt.format, "framework": m.framework, "step": m.step,
            "world_size": m.world_size if ckpt.format == "hybrid" else None,
            "tensors": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in m.plan.specs],
            "buffers": sorted(m.buffers),
            "optimizer": None if opt is None else {
                "name": opt.name, "slots": list(opt.slots), "count": opt.count, "counts": opt.counts,
                "without_state": list(opt.without_state),
                "param_groups": opt.hyperparameters.get("param_groups", [])},
            "scheduler": "scheduler" in m.run_state,
            "carried": [".".join(map(str, e["path"])) for e in m.run_state.get("carried", {}).get("entries", [])],
            "left_out": list(m.metadata.get("left_out", [])),
            "carried_values": _scalars(m.run_state),
            "state_arrays": list(m.metadata.get("state_arrays", [])),
            "unnamed": m.metadata.get("unnamed_param_shards"),
            "zero_layout": m.metadata.get("zero_layout")}


def _scalars(run_state: dict) -> dict:
    """``{dotted path: value}`` of the carried entries that are plain numbers (an orbax save's
    schedule counts, MultiSteps' and apply_if_finite's counters), which ``load`` puts back."""
    from hybrid.checkpoint._other_state import carried_entries, dotted

    return {dotted(p): v for p, v in carried_entries(run_state) if isinstance(v, (bool, int, float))}


def _print_info(d: dict) -> None:
    print(f"{d['path']}: {d['format']} checkpoint ({d['framework']}), step {d['step']}"
          + (f", {d['world_size']} rank files" if d["world_size"] else ""))
    numel = sum(_numel(t["shape"]) for t in d["tensors"])
    print(f"  {len(d['tensors'])} parameters, {numel:,} elements; buffers: {d['buffers'] or 'none'}")
    opt = d["optimizer"]
    if opt is None:
        print("  no optimizer state")
    else:
        print(f"  optimizer {opt['name']}: slots {opt['slots']}, {opt['count']} steps"
              + (f" (per parameter: {opt['counts']})" if opt["counts"] else "")
              + (f"; no state yet: {opt['without_state']}" if opt["without_state"] else ""))
        for i, g in enumerate(opt["param_groups"]):
            hyper = {k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay", "momentum", "amsgrad")}
            print(f"  param group {i}: {hyper} over {len(g.get('param_names', []))} parameters")
    if d["scheduler"]:
        print("  LR scheduler state (load(..., scheduler=) restores it)")
    if d.get("zero_layout"):
        z = d["zero_layout"]
        print(f"  optimizer state as hybrid.jax.zero's flat buckets: {z['buckets']} bucket(s) of {z['lengths']} "
              f"elements before padding (plan {z['plan']}, recognised by {z.get('recognised_by', 'its lengths')}); "
              f"loads at any device count and stage")
    if d["carried"]:
        values = d.get("carried_values", {})
        shown = [f"{n} = {values[n]}" if n in values else n for n in d["carried"]]
        print(f"  carried (the run's other state, kept through convert; optax state scalars load as saved): {shown}")
    if d.get("unnamed"):
        print(f"  {d['unnamed']}")
    if d.get("state_arrays"):
        print(f"  optimizer state arrays beside the moments, loaded as saved (MultiSteps' acc_grads): {d['state_arrays']}")
    if d["left_out"]:
        print(f"  left out (not model, optimizer or step): {d['left_out']}")
    for t in d["tensors"]:
        print(f"    {t['name']:40s} {t['dtype']:9s} {t['shape']}")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run(args) -> int:
    options = dict(format=args.source_format, step=args.step)
    try:
        if args.zero_stage is not None:  # the orbax reader's option; other formats' readers take none
            source = args.path if args.action == "info" else args.src
            found = args.source_format or detect_format(source)
            if found != "orbax":
                print(f"--zero-stage is for an orbax save of hybrid.jax.zero's state; {source} holds a {found} "
                      f"checkpoint", file=sys.stderr)
                return 2
            options["zero_stage"] = args.zero_stage
        if args.action == "info":
            d = describe(open_checkpoint(args.path, **options))
            print(json.dumps(d, indent=1)) if args.json else _print_info(d)
            return 0
        if args.world_size < 1:
            print(f"--world-size must be at least 1, got {args.world_size}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()

        def progress(line: str) -> None:
            print(f"[{time.perf_counter() - t0:6.1f} s] {line}", file=sys.stderr, flush=True)

        groups = None
        if args.param_groups:
            with open(args.param_groups) as f:
                groups = json.load(f)
        done = convert(args.src, args.dst, to=args.to, world_size=args.world_size,
                       mapping=_object(args.mapping) if args.mapping else None,
                       like=_object(args.like) if args.like else None, param_groups=groups, progress=progress,
                       **options)
    except (CheckpointError, FileExistsError, ValueError) as e:  # MappingError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    if done.left_out:
        print(f"left out (no format hybrid writes holds them): {list(done.left_out)}", file=sys.stderr)
    print(f"{args.dst}: {done.format} checkpoint at step {done.step}, {done.num_tensors} tensors "
          f"(from {done.source_format})")
    return 0
