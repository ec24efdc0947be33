"""Which modules of a ZeRO3 model carry its hooks: the *units* that gather, swap and free.

Eager, every module holding parameters of its own is a unit (``policy="memory"`` gathers a module's
bucket just before it runs). Under ``torch.compile`` every hook is a graph break (dynamo must not
trace a collective, nor the schedule's Python state), so units are what FSDP2 users wrap with
``fully_shard``, and the graph breaks fall between them, not around every layer:

* a module compiled before wrapping (``block.compile()``, torchtitan's per-block compile) is one
  unit with everything under it: its compiled forward holds no hook, and runs as one graph (the
  root compiled before wrapping, ``model.compile()``, is the only unit: every bucket is gathered
  for its forward);
* when the whole model is compiled (``torch.compile(zero3_model)``), each entry of an
  ``nn.ModuleList`` / ``nn.ModuleDict`` (a transformer's blocks) is a unit, and every module with
  parameters outside those (embeddings, the final norm, the head) is one. Each unit's forward is a
  graph of its own; the code between them (the loop over the blocks) runs eagerly, as dynamo runs
  a frame that breaks inside a loop. (A root unit holding the embeddings and the head, as
  torchtitan's root ``fully_shard``, would leave those uncompiled for that reason.)

A unit gathers the buckets of every parameter under it (so a memory-first model holds a block's
buckets at once under compile, as FSDP2 does), puts all of them in place before its forward and
frees them after (buckets still needed by a later unit stay).
"""

from __future__ import annotations

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on it (torch keeps the compiled ``_call_impl``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def select_units(root: nn.Module, holds_params, *, whole_compiled: bool) -> list[nn.Module]:
    """The unit modules of ``root``, in ``root.modules()`` order (the root first, always: a call of it
    opens a forward). ``holds_params(m)``: whether ``m`` holds sharded parameters (or declared
    external ones) itself.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.ReLU())]))
    >>> own = lambda m: isinstance(m, nn.Linear)
    >>> [type(m).__name__ for m in select_units(net, own, whole_compiled=False)]
    ['Sequential', 'Linear', 'Linear']
    >>> [type(m).__name__ for m in select_units(net, own, whole_compiled=True)]
    ['Sequential', 'Linear', 'Sequential']
    """
    units, covered = [root], set()
    if is_compiled(root):
        return units

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if id(child) in covered:
                continue  # a module registered twice belongs to its first place
            whole = is_compiled(child) or (whole_compiled and isinstance(m, _CONTAINERS))
            if whole:
                covered.update(id(x) for x in child.modules())
                if any(holds_params(x) for x in child.modules()):
                    units.append(child)
                continue
            covered.add(id(child))
            if holds_params(child):
                units.append(child)
            visit(child)

    visit(root)
    return units
