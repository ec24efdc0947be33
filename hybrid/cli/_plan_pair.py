"""``python -m hybrid plan --jax PKG.MOD:FACTORY``: the plan of a JAX model through a mapping.

The JAX half is a parity factory (``() -> (params, loss_fn(params, batch))``, as
``python -m hybrid parity`` takes). Its tree is paired with torch's names and layouts
(:class:`hybrid.core.ParamMapping`, flax linen's rules unless ``--mapping`` names another), and
planned as ``hybrid.jax`` plans it with that pairing: over torch's tensors, in a gradient-ready
order when ``--data`` gives a batch (what torch's DDP holds after its rebuild), else in torch's
registration order (what it holds before). Each tensor is listed with its names on both sides, its
layout and the rule that placed it.

With ``--torch PKG.MOD:FACTORY`` too, the torch half's names and shapes are the pairing's other
side (a tensor the mapping cannot place is an error naming it), and, with ``--data``, the order is
torch's own: one forward and backward of the torch module observes it
(:func:`hybrid.torch.gradient_ready_order`); then torch's own ``DistributedDataParallel`` trains two
steps on one gloo rank, as a user at those flags would build it, and its buckets after the rebuild
are compared with the plan, bucket by bucket. With ``--data`` and no ``--torch``, the order is the
JAX backward's through the rules, with the modules torch computes in one backward node (a
``grads_together`` rule, or a norm-like module) put in torch's order; the report names them.
"""

from __future__ import annotations

import datetime

import numpy as np

from hybrid.cli._plan_options import Caps
from hybrid.cli._table import format_table
from hybrid.core import BucketPlan, ParamMapping, ParamPairing


def pair_plan(jax: str, *, torch: str | None, mapping: str | None, data: str | None,
              caps: Caps) -> tuple[str, BucketPlan, dict]:
    """The plan of the JAX factory ``jax``'s tree through the mapping, and the pairing section of
    the report; ``torch``, ``mapping``, ``data``: the other factories' ``"pkg.mod:name"``."""
    from hybrid.parity._spec import load_factory, load_reference

    from hybrid.jax._ready import gradient_ready_order
    from hybrid.jax._specs import _Layout, _leaves

    try:
        params, loss_fn = load_factory(jax, "--jax")()
        found = ParamMapping.flax() if mapping is None else load_reference(mapping, "--mapping")
        batch = None if data is None else load_factory(data, "--data")(0)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"hybrid plan: {e}")
    if not isinstance(found, ParamMapping):
        raise SystemExit(f"hybrid plan: --mapping {mapping!r} is a {type(found).__name__}, not a "
                         "hybrid.core.ParamMapping")
    torch_pair = None
    if torch is not None:
        import torch as th
        th.manual_seed(0)
        torch_pair = load_factory(torch, "--torch")()
    pairing = _pairing(params, found, torch_pair)
    ready = None if batch is None else gradient_ready_order(loss_fn, params, batch)
    section = {}
    if ready is not None and torch_pair is not None:
        by_rules = pairing.torch_ready_order(ready)
        pairing = pairing.with_torch_ready(_observed(torch_pair, batch))
        section["rules_order_agrees"] = _first_difference(by_rules, pairing.torch_ready_order(ready))
    elif ready is not None:
        section["assumed_together"] = pairing.computed_together()
    layout = _Layout.of(params, what="hybrid plan", order=None, ready_order=ready, pairing=pairing,
                        bucket_cap_bytes=caps.bucket_cap_bytes, first_bucket_cap_bytes=caps.first_bucket_cap_bytes)
    plan = layout.plan
    order = ("torch" if pairing.torch_ready else "ready") if ready is not None else (
        "registration" if torch_pair is not None else "leaves")
    section.update(order=order, pairing_fingerprint=pairing.fingerprint(), tensors=_rows(plan, pairing))
    if torch_pair is not None and batch is not None:
        section["torch_check"] = _torch_check(torch_pair, batch, plan, caps)
    names, _, _ = _leaves(params)
    return f"{jax} ({len(names)} JAX leaves, paired with torch's names)", plan, section


def _tensors(batch):
    import torch
    from torch.utils._pytree import tree_map
    return tree_map(lambda x: torch.from_numpy(np.asarray(x)), batch)  # as the parity harness's ranks


def _observed(torch_pair, batch) -> list[str]:
    """torch's own gradient-ready order of the torch half on ``batch`` (one forward and backward)."""
    from hybrid.parity._bridge import observed_ready_order
    module, loss_fn = torch_pair
    return observed_ready_order(module, loss_fn, _tensors(batch))


def _first_difference(rules: tuple, observed: tuple) -> dict:
    """Where the order inferred from JAX's backward and the rules first departs from torch's own."""
    k = next((i for i, (a, b) in enumerate(zip(rules, observed)) if a != b), None)
    if k is None and len(rules) != len(observed):
        k = min(len(rules), len(observed))
    if k is None:
        return {"equal": True}
    return {"equal": False, "index": k, "rules": list(rules[k:k + 3]), "torch": list(observed[k:k + 3])}


def _pairing(params, mapping: ParamMapping, torch_pair) -> ParamPairing:
    from hybrid.core import MappingError
    from hybrid.jax._specs import _leaves
    try:
        if torch_pair is not None:
            from hybrid.parity._bridge import pair_models
            return pair_models(torch_pair[0], params, mapping)
        names, leaves, _ = _leaves(params)
        return mapping.pair(dict(zip(names, (tuple(x.shape) for x in leaves))))
    except MappingError as e:
        raise SystemExit(f"hybrid plan: {e}")


def _rows(plan: BucketPlan, pairing: ParamPairing) -> list[dict]:
    """One row per tensor in the order the buckets are reduced: its bucket and both sides' names."""
    by_torch = {p.torch: p for p in pairing.pairs}
    rows = []
    for b, bucket in enumerate(plan.buckets):
        for m in bucket.members:
            p = by_torch[plan.specs[m].name]
            rows.append({"bucket": b, "torch": p.torch, "jax": p.jax, "torch_shape": list(p.torch_shape),
                         "jax_shape": list(p.jax_shape), "layout": str(p.layout), "rule": p.rule})
    return rows


def _torch_check(torch_pair, batch, plan: BucketPlan, caps: Caps) -> dict:
    """torch's own DistributedDataParallel on one gloo rank, two steps, built as a user at ``caps``
    builds it: its buckets after the rebuild (parameter names, as a comm hook sees them) against
    ``plan``'s."""
    import torch.distributed as dist

    from hybrid.demo._world import free_port
    from hybrid.parity._run_torch import torch_ddp_buckets

    if not caps.as_torch_builds_them:
        # torch's DDP has no first-bucket cap argument: 1 MiB at its default cap, else the cap itself
        return {"skipped": "torch's DDP caps its first bucket at 1 MiB when bucket_cap_mb is left out and at "
                           "bucket_cap_mb when it is given; --first-bucket-cap-mb differs"}
    module, loss_fn = torch_pair
    tensors = _tensors(batch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        # torch exactly as a user at these flags builds it: no bucket_cap_mb argument at the default,
        # since an explicit one caps the first bucket too (torch's _BucketCapacityConfig.create)
        theirs = torch_ddp_buckets(module, lambda ddp, step: loss_fn(ddp, tensors).backward(),
                                   bucket_cap_mb=caps.bucket_cap_mb)
    finally:
        dist.destroy_process_group()
    ours = [[plan.specs[m].name for m in b.members] for b in plan.buckets]
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first is None and len(ours) != len(theirs):
        first = min(len(ours), len(theirs))
    return {"equal": first is None, "torch_buckets": theirs, "first_difference": first}


def print_pairing(section: dict) -> None:
    order = {"torch": "torch's own gradient-ready order, observed on one step of the torch half, as torch's DDP "
                      "holds them after its rebuild",
             "ready": "the gradient-ready order inferred from the JAX backward and the rules, as torch's DDP would "
                      "hold them after its rebuild (give --torch for torch's own)",
             "registration": "torch's registration order, as torch's DDP holds them before its first rebuild "
                             "(give --data for after)",
             "leaves": "the JAX tree's leaf order (give --torch for torch's registration order, --data for the "
                       "order torch's DDP rebuilds in)"}[section["order"]]
    print(f"\nTensors on both sides, bucket by bucket ({order}; pairing {section['pairing_fingerprint']}):")
    print(format_table(["bucket", "torch name", "torch shape", "JAX name", "JAX shape", "layout", "rule"],
                       [[r["bucket"], r["torch"], "x".join(map(str, r["torch_shape"])) or "scalar", r["jax"],
                         "x".join(map(str, r["jax_shape"])) or "scalar", r["layout"], r["rule"]]
                        for r in section["tensors"]]))
    _print_order_notes(section)
    check = section.get("torch_check")
    if check is None:
        return
    if "skipped" in check:
        print(f"\ntorch's own DDP not compared: {check['skipped']}")
    elif check["equal"]:
        print(f"\ntorch's own DistributedDataParallel after its rebuild (2 steps, 1 gloo rank, as built at these "
              f"flags): the same "
              f"{len(check['torch_buckets'])} bucket(s), tensor for tensor")
    else:
        k = check["first_difference"]
        theirs = check["torch_buckets"][k] if k < len(check["torch_buckets"]) else "(none)"
        print(f"\ntorch's own DistributedDataParallel after its rebuild DIFFERS from this plan at bucket {k}: "
              f"torch holds {theirs}")


def _print_order_notes(section: dict) -> None:
    """Which order was assumed inside modules, or whether the rules alone would have found torch's."""
    if section["order"] in ("ready", "leaves"):
        print("\nWithout --torch the tensors stand in the JAX tree's leaf order: ZeRO-3's plan above follows "
              "torch's registration order only with --torch, so its fingerprint is torch ZeRO3's only then.")
    assumed = section.get("assumed_together")
    if assumed is not None:
        why = {"rule": "a grads_together rule", "norm-like": "norm-like: a 1-D weight and a bias of its shape"}
        listed = "; ".join(f"{m or '(root)'} ({why[w]})" for m, w in assumed.items()) or "none"
        print(f"\nAssumed, with no torch half to observe: torch computes these modules' gradients in one backward "
              f"node, weight before bias (the JAX backward computes the bias first): {listed}. Give --torch to "
              f"take torch's own order instead.")
    agrees = section.get("rules_order_agrees")
    if agrees is None:
        return
    if agrees["equal"]:
        print("\nThe order inferred from the JAX backward and the rules (what a JAX-only run plans) is torch's own.")
    else:
        print(f"\nThe order inferred from the JAX backward and the rules differs from torch's own at ready position "
              f"{agrees['index']}: the rules give {agrees['rules']}, torch {agrees['torch']}. This plan follows "
              f"torch's; a JAX-only run (no torch half) would not: mark the module's rules grads_together=True "
              f"(or False) to say how torch computes its gradients.")
