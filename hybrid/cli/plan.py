"""``python -m hybrid plan``: the bucket table and the ZeRO view of a model.

Sources: a built-in example (``--model``), a torch module factory (``--module pkg.mod:factory``),
a JSON list of specs (``--specs FILE``), or a JAX model through a mapping (``--jax``, with
``--torch``, ``--mapping`` and ``--data``: ``_plan_pair``). ``--json`` prints one JSON object
instead of tables. ``--compile`` traces a torch module with dynamo and prints the pieces
``torch.compile(hybrid DDP)`` cuts its graph(s) into (``_plan_compile``); ``--project`` the
communication at scale (``_project``). This module turns the command line into plain values
(:class:`~hybrid.cli._plan_options.Caps`, :class:`~hybrid.cli._plan_options.ZeroView`,
:class:`~hybrid.cli._project.Projection`); the report is ``_plan_report``'s.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from hybrid.cli import _plan_compile, _plan_pair, _plan_report, _project
from hybrid.cli._plan_options import Caps, ZeroView
from hybrid.cli._plan_report import LEGEND, NEXT
from hybrid.core import OPTIMIZER_STATE_COPIES, TensorSpec
from hybrid.core._spec import check_specs, specs_from_json
from hybrid.models._examples import EXAMPLES


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
    _pair_arguments(p, source)
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
    _projection_arguments(p)
    return p


def _pair_arguments(p, source) -> None:
    source.add_argument("--jax", metavar="PKG.MOD:FACTORY",
                        help="a JAX model: FACTORY() -> (params, loss_fn(params, batch)), paired with torch's "
                             "names through --mapping and planned as hybrid.jax plans it")
    p.add_argument("--torch", metavar="PKG.MOD:FACTORY",
                   help="with --jax: the torch half, FACTORY() -> (module, loss_fn(module, batch)); its names "
                        "are the pairing's other side, and with --data torch's own DDP buckets are the check")
    p.add_argument("--mapping", metavar="PKG.MOD:NAME",
                   help="with --jax: a hybrid.core.ParamMapping (default: flax linen's rules)")
    p.add_argument("--data", metavar="PKG.MOD:FN",
                   help="with --jax: data(step) -> a global batch; step 0's gives the gradient-ready order (the "
                        "plan torch's DDP holds after its rebuild): torch's own backward with --torch, else JAX's")


def _projection_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("projection (--project)")
    g.add_argument("--project", action="store_true",
                   help="project per-step communication at scale: DDP and ZeRO-1/2/3 on named networks")
    g.add_argument("--ranks", default="8,64,512", help="comma-separated world sizes to project (default 8,64,512)")
    g.add_argument("--tokens", type=int, default=8192, help="tokens (or samples) per rank per step")
    g.add_argument("--mfu", type=float, default=0.4, help="fraction of the device's peak the compute reaches")
    g.add_argument("--device-tflops", type=float, default=989.0, help="peak dense TFLOP/s (H100 bf16: 989)")
    g.add_argument("--cost", metavar="FILE|measure",
                   help="add this machine's process group: a CostModel JSON (hybrid.torch.measure_collectives "
                        "caches one under ~/.cache/hybrid), or 'measure' to measure 2 gloo ranks here now")


def load_specs(*, specs: Path | None = None, module: str | None = None,
               model: str = "gpt2-small") -> tuple[str, tuple[TensorSpec, ...]]:
    """The specs of a JSON file, a torch module factory or a built-in example, and a label for them."""
    if specs is not None:
        try:
            data = json.loads(specs.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"hybrid plan: cannot read specs from {specs}: {e}")
        items = data["specs"] if isinstance(data, dict) else data
        try:
            return str(specs), specs_from_json(items)
        except (KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"hybrid plan: bad spec in {specs}: {e!r}")
    if module is not None:
        return module, specs_of_module(module)
    return model, check_specs(EXAMPLES[model]())


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


def _options(args) -> tuple[Caps, ZeroView, _project.Projection | None]:
    """The command line as plain values; a bad one exits with a message naming the option."""
    if args.jax is None:
        for name in ("torch", "mapping", "data"):
            if getattr(args, name) is not None:
                raise SystemExit(f"hybrid plan: --{name} goes with --jax (the JAX half it pairs with)")
    elif args.compile:
        raise SystemExit("hybrid plan: --compile traces a torch module: give --module, not --jax")
    try:
        ranks = tuple(int(r) for r in args.ranks.split(","))
    except ValueError:
        raise SystemExit(f"hybrid plan: --ranks wants comma-separated integers, got {args.ranks!r}")
    try:
        caps = Caps(args.bucket_cap_mb, args.first_bucket_cap_mb)
        view = ZeroView(args.world_size, args.optimizer, args.prefetch, args.master_weights)
        projection = (_project.Projection(ranks, args.tokens, args.mfu, args.device_tflops, args.cost)
                      if args.project else None)
    except ValueError as e:
        raise SystemExit(f"hybrid plan: {e}")
    return caps, view, projection


def run(args) -> int:
    caps, view, projection = _options(args)
    if args.jax is not None:
        label, plan, pairing = _plan_pair.pair_plan(args.jax, torch=args.torch, mapping=args.mapping, data=args.data,
                                                    caps=caps)
        specs = plan.specs
        report = _plan_report.build_report(label, specs, view, caps, plan=plan)
        report["pairing"] = pairing
    else:
        label, specs = load_specs(specs=args.specs, module=args.module, model=args.model or "gpt2-small")
        report = _plan_report.build_report(label, specs, view, caps)
    if args.compile:
        module = _plan_compile.torch_module(args.module, None if args.specs else args.model or "gpt2-small")
        report["compile"] = _plan_compile.compile_report(module, specs, tuple(report["size_limits"]), args.input_shape)
    if projection is not None:
        report["projection"] = _project.projection_report(specs, projection)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _plan_report.print_report(report)
        if projection is not None:
            _project.print_projection(report["projection"])
    return 0
