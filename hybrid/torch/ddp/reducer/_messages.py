"""torch's reducer.cpp error texts, verbatim (scripts and log scrapers match on them): a
reduction that did not finish before the next forward, a gradient marked ready twice."""

from __future__ import annotations

import torch.distributed as dist

# torch's reducer.cpp texts for a reduction that did not finish, verbatim (scripts and log
# scrapers match on them).
_UNFINISHED = "Expected to have finished reduction in the prior iteration before starting a new one. "
_GRAPH_CHANGED = ("This error indicates that your training graph has changed in this iteration, e.g., one "
                  "parameter is used in first iteration, but then got unused in the second iteration. this "
                  "is not compatible with static_graph set to True.")
_UNUSED = "This error indicates that your module has parameters that were not used in producing loss. "
_ENABLE_DETECTION = ("You can enable unused parameter detection by passing the keyword argument "
                     "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \n")
_DETECTION_ON = ("Since `find_unused_parameters=True` is enabled, this likely  means that not all `forward` "
                 "outputs participate in computing loss. You can fix this by ")
_OUTPUTS = "making sure all `forward` function outputs participate in calculating loss. "
_DDP_BUG = ("\nIf you already have done the above, then the distributed data parallel module wasn't able to "
            "locate the output tensors in the return value of your module's `forward` function. Please "
            "include the loss function and the structure of the return value of `forward` of your module "
            "when reporting this issue (e.g. list, dict, iterable).")


def unfinished_reduction_message(rank: int, missing, names, *, static_graph: bool,
                                 find_unused_parameters: bool) -> str:
    """torch's error when a forward starts before the previous iteration's reduction finished.

    As torch's, it lists the indices of the parameters that got no gradient and, under
    ``TORCH_DISTRIBUTED_DEBUG=INFO`` or ``DETAIL``, their names before the indices, last
    registered first (the order torch's name map iterates in, checked up to 80 parameters). With
    debugging off, torch ends with advice to turn it on; hybrid names the parameters there instead
    (the one place its text differs from torch's: the names are what the advice was for).

    >>> print(unfinished_reduction_message(0, (2, 3), ["a.weight", "a.bias", "b.weight", "b.bias"],
    ...       static_graph=True, find_unused_parameters=False).splitlines()[-1])
    Parameters which did not receive grad for rank 0: b.bias, b.weight
    """
    if static_graph:
        text = _UNFINISHED + _GRAPH_CHANGED
    elif not find_unused_parameters:
        text = _UNFINISHED + _UNUSED + _ENABLE_DETECTION + _OUTPUTS + _DDP_BUG
    else:
        text = _UNFINISHED + _UNUSED + _DETECTION_ON + _OUTPUTS + _DDP_BUG
    indices = f"\nParameter indices which did not receive grad for rank {rank}: {' '.join(map(str, missing))}"
    named = (f"\nParameters which did not receive grad for rank {rank}: "
             f"{', '.join(names[i] for i in sorted(missing, reverse=True))}")
    if dist.get_debug_level() == dist.DebugLevel.OFF:
        return text + indices + named
    return text + named + indices


_MARKED_TWICE = (
    "Expected to mark a variable ready only once. This error is caused by one of the following reasons: "
    "1) Use of a module parameter outside the `forward` function. Please make sure model parameters are "
    "not shared across multiple concurrent forward-backward passes. or try to use _set_static_graph() as a "
    "workaround if this module graph does not change during training loop.2) Reused parameters in multiple "
    "reentrant backward passes. For example, if you use multiple `checkpoint` functions to wrap the same "
    "part of your model, it would result in the same set of parameters been used by different reentrant "
    "backward passes multiple times, and hence marking a variable ready multiple times. DDP does not "
    "support such use cases in default. You can try to use _set_static_graph() as a workaround if your "
    "module graph does not change over iterations.")


def marked_twice_message(index: int, name: str) -> str:
    """torch's error (verbatim, its double space included) when a parameter's gradient hook fires
    twice in one iteration: a reentrant ``checkpoint`` over it with ``find_unused_parameters``, or
    a parameter shared by concurrent forward-backward passes.

    >>> marked_twice_message(1, "a.bias").splitlines()[1][:48]
    'Parameter at index 1 with name a.bias has been m'
    """
    return (f"{_MARKED_TWICE}\nParameter at index {index} with name {name} has been marked as ready twice. "
            "This means that multiple autograd engine  hooks have fired for this particular parameter "
            "during this iteration.")
