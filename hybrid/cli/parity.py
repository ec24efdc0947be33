"""``python -m hybrid parity``: a user's torch/JAX model pair trained by both frontends and compared.

The pair and its data are named by reference (``pkg.module:name``, importable from the current
directory): ``--torch`` a factory ``() -> (module, loss_fn(module, batch))``, ``--jax`` a factory
``() -> (params, loss_fn(params, batch))``, ``--data`` a function ``data(step) -> global batch``
(numpy arrays), ``--mapping`` a ``hybrid.core.ParamMapping`` (or a function returning one; default
flax linen's rules). Prints the report (``--json``: as JSON) and exits 1 when the two disagree
beyond the tolerance or ran different bucket plans. See docs/parity.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from hybrid.cli._host import ask_host_devices


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("parity", help="train a torch/JAX model pair with both frontends and compare them",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torch", required=True, metavar="PKG.MOD:FACTORY", help="() -> (torch module, loss_fn)")
    p.add_argument("--jax", required=True, metavar="PKG.MOD:FACTORY", help="() -> (params, loss_fn)")
    p.add_argument("--data", required=True, metavar="PKG.MOD:FN", help="data(step) -> global batch (numpy)")
    p.add_argument("--mapping", metavar="PKG.MOD:NAME", help="a ParamMapping (default: flax linen's rules)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--world-size", type=int, default=2, help="torch gloo ranks (default 2)")
    p.add_argument("--devices", type=int, default=2, help="JAX host devices (default 2)")
    p.add_argument("--stage", type=int, default=1, help="0: DDP alone, 1: ZeRO-1, 2: ZeRO-2, 3: ZeRO-3 (default 1)")
    p.add_argument("--optimizer", default="adam", help="sgd, adam or adamw (default adam)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--momentum", type=float, default=0.0, help="sgd's momentum")
    p.add_argument("--eps", type=float, default=1e-8, help="adam's eps (default 1e-8)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the torch factory (default 0)")
    p.add_argument("--tolerance", metavar="LOSS_RTOL,LOSS_ATOL,PARAM_RTOL,PARAM_ATOL",
                   help="the run's tolerances (default 1e-5,1e-6,1e-4,1e-5)")
    p.add_argument("--param-tolerance", metavar="PATTERN=RTOL,ATOL", action="append", default=[],
                   help="hold the parameters whose torch name matches PATTERN (fnmatch) to their own pair; "
                        "repeatable, the first match wins")
    p.add_argument("--plot", metavar="FILE.png", help="save the loss curves and their difference")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _problem(args) -> str | None:
    """What is wrong with the numeric options, naming the option; None if nothing."""
    for name in ("steps", "world_size", "devices"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.stage not in (0, 1, 2, 3):
        return f"--stage must be 0, 1, 2 or 3, got {args.stage}"
    if args.seed < 0:
        return f"--seed must be >= 0, got {args.seed}"
    for name in ("lr", "eps", "weight_decay", "momentum"):
        if not math.isfinite(getattr(args, name)):
            return f"--{name.replace('_', '-')} must be a finite number, got {getattr(args, name)}"
    return None


def tolerance_of(tolerance: str | None, param_tolerance: list[str] = ()):
    """The :class:`~hybrid.parity.Tolerance` of ``--tolerance`` and ``--param-tolerance`` (their
    texts); a ValueError naming the option for a malformed one.

    >>> tolerance_of("1e-5,1e-6,1e-3,1e-4", ["h.*.bias=0,1e-3"])
    Tolerance(loss_rtol=1e-05, loss_atol=1e-06, param_rtol=0.001, param_atol=0.0001, per_tensor=(('h.*.bias', 0.0, 0.001),))
    """
    from hybrid.parity._report import Tolerance

    def numbers(text: str, n: int, option: str) -> list[float]:
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) != n:
            raise ValueError(f"{option} wants {n} comma-separated numbers, got {text!r}")
        return values

    base = numbers(tolerance, 4, "--tolerance") if tolerance else []
    per_tensor = []
    for item in param_tolerance:
        pattern, sep, pair = item.partition("=")
        if not sep or not pattern:
            raise ValueError(f"--param-tolerance wants PATTERN=RTOL,ATOL, got {item!r}")
        per_tensor.append((pattern, *numbers(pair, 2, f"--param-tolerance {pattern}")))
    return Tolerance(*base, per_tensor=tuple(per_tensor))


def run(args) -> int:
    """The command; 0 when the pair agrees, 1 when it does not, 2 on bad input."""
    problem = _problem(args)
    if problem:
        print(f"hybrid parity: {problem}", file=sys.stderr)
        return 2
    ask_host_devices(args.devices, cpu=False)
    sys.path.insert(0, os.getcwd())  # the user's pair, as `python -m` would find it
    from hybrid.core import MappingError, ParamMapping
    from hybrid.parity._spec import OptimizerSpec, load_factory, load_reference

    try:
        optimizer = OptimizerSpec(args.optimizer, lr=args.lr, eps=args.eps, weight_decay=args.weight_decay,
                                  momentum=args.momentum)
        tolerance = tolerance_of(args.tolerance, args.param_tolerance)
        mapping = None
        if args.mapping:
            found = load_reference(args.mapping, "--mapping")
            mapping = found() if callable(found) else found
            if not isinstance(mapping, ParamMapping):
                raise TypeError(f"--mapping {args.mapping!r} must name a hybrid.core.ParamMapping (or a function "
                                f"returning one), got {type(mapping).__name__}")
        data = load_factory(args.data, "--data")
        for option in ("torch", "jax"):  # found now, so a typo is a message, not a traceback from a torch rank
            load_factory(getattr(args, option), f"--{option}")
    except (ValueError, TypeError) as e:
        print(f"hybrid parity: {e}", file=sys.stderr)
        return 2
    from hybrid.parity import run as run_parity  # torch and JAX: imported once the input is known good
    from hybrid.parity._report import ToleranceError

    try:
        report = run_parity(args.torch, args.jax, data, steps=args.steps, optimizer=optimizer,
                            world_size=args.world_size, num_devices=args.devices, stage=args.stage, mapping=mapping,
                            seed=args.seed, tolerance=tolerance)
    except MappingError as e:  # the pair's names or shapes; errors of the user's own code raise with their traceback
        print(f"hybrid parity: the mapping cannot pair the two models: {e}", file=sys.stderr)
        return 2
    except ToleranceError as e:  # checked before anything trained
        print(f"hybrid parity: --param-tolerance: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json()) if args.json else report.summary())
    if args.plot:
        report.plot(args.plot)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0 if report.ok and report.plans_match else 1
