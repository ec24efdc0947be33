"""dynamo's decorators on hybrid's code, applied when ``torch._dynamo`` is imported, not before.

``import torch._dynamo`` costs about 1 s of CPU (it pulls in much of inductor), part of it in
modules hybrid imports anyway; left out, ``import hybrid.torch`` took 2.2-2.5 s of CPU (user+sys)
where it took 2.8-3.1 s (torch 2.13 CPU, 2-core VM shared with others), paid by every rank
process, most of which never compile anything. Nothing can be compiled before ``torch._dynamo``
is imported (``torch.compile`` imports it first), so until then ``torch._dynamo.disable`` and
``skip`` change nothing, and they are applied the moment it is:

* :func:`disable` (``torch._dynamo.disable``, recursive) on a method or module-level function:
  the name in its class or module is rebound to the real wrapper, whose frame lives in dynamo's
  ``eval_frame.py`` and turns dynamo's callback off for the call. A wrapper of our own would be a
  hybrid frame that dynamo converts (more frames, other graph counts), so the real one it is.
* :func:`skip` (``torch._dynamo.decorators.skip``) marks the function's code skipped and
  returns the function itself: applied later to the same object, it is the same.
* :func:`register_disabled_hook`: a module hook registered before the import is rebound, in the
  module's hook dict under its handle's id (its place in the order kept), to the real wrapper.

No torch API gives the effect without the package: ``torch.compiler.disable`` imports it, and
``torch._C._dynamo`` has the eval-frame switch and code flags but not the wrapper's code object.

When ``torch._dynamo`` is already imported, each is applied on the spot, as before. The import is
watched by a finder at the head of ``sys.meta_path`` that answers only for ``torch._dynamo`` and
runs the pending work right after the package's ``__init__`` has run, before any caller could
compile; it then takes itself off ``sys.meta_path``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

_DYNAMO = "torch._dynamo"
_pending_disable: list[Callable] = []
_pending_skip: list[Callable] = []
_pending_hooks: "weakref.WeakSet" = weakref.WeakSet()  # RemovableHandles of hooks to wrap


def loaded() -> bool:
    """Whether ``torch._dynamo`` is imported (before it is, nothing can be compiled)."""
    return _DYNAMO in sys.modules


def disable(fn: Callable) -> Callable:
    """``torch._dynamo.disable(fn)`` (recursive) on a method or module-level function, as a decorator:
    the real one now if ``torch._dynamo`` is imported, else on its class or module once it is."""
    if loaded():
        return torch._dynamo.disable(fn)
    if "<locals>" in fn.__qualname__:
        raise AssertionError(f"{fn.__qualname__}: only methods and module-level functions can be disabled later")
    _pending_disable.append(fn)
    _watch()
    return fn


def skip(fn: Callable) -> Callable:
    """``torch._dynamo.decorators.skip(fn)``: ``fn`` itself, its code skipped by dynamo (now if
    ``torch._dynamo`` is imported, else once it is)."""
    if loaded():
        return torch._dynamo.decorators.skip(fn)
    _pending_skip.append(fn)
    _watch()
    return fn


def register_disabled_hook(register: Callable, hook: Callable, **kwargs: Any):
    """``register(torch._dynamo.disable(hook, recursive=True), **kwargs)``, e.g.
    ``register_disabled_hook(module.register_forward_pre_hook, fn)``: dynamo runs the hook as a
    graph break, never traces it. Before ``torch._dynamo`` is imported ``hook`` is registered as it
    is, and replaced by its disabled wrapper under the same handle once it is imported."""
    if loaded():
        return register(torch._dynamo.disable(hook, recursive=True), **kwargs)
    handle = register(hook, **kwargs)
    _pending_hooks.add(handle)
    _watch()
    return handle


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returned (dynamo's ``OptimizedModule``)."""
    return loaded() and isinstance(module, sys.modules["torch._dynamo.eval_frame"].OptimizedModule)


def _apply(dynamo) -> None:
    """Apply every pending decorator and hook wrapper, with ``dynamo`` the imported package."""
    while _pending_skip:
        dynamo.decorators.skip(_pending_skip.pop())
    while _pending_disable:
        fn = _pending_disable.pop()
        *path, name = fn.__qualname__.split(".")
        owner = sys.modules[fn.__module__]
        for part in path:
            owner = getattr(owner, part)
        if vars(owner).get(name) is fn:   # one replaced meanwhile would have replaced the wrapper too
            setattr(owner, name, dynamo.disable(fn))
    for handle in list(_pending_hooks):
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:   # neither removed nor its module dropped
            hooks[handle.id] = dynamo.disable(hooks[handle.id], recursive=True)
    _pending_hooks.clear()


class _WatchDynamo:
    """A ``sys.meta_path`` finder for ``torch._dynamo`` alone: finds it as the path finder does (it
    is a package on disk, under ``torch``) and runs :func:`_apply` right after its ``__init__``."""

    def find_spec(self, name, path, target=None):
        if name != _DYNAMO:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader

        def exec_module(module):
            try:
                type(loader).exec_module(loader, module)
            finally:
                del loader.exec_module   # the loader as it was
            _unwatch()
            _apply(module)
        loader.exec_module = exec_module
        return spec


_watcher = _WatchDynamo()


def _watch() -> None:
    if _watcher not in sys.meta_path:
        sys.meta_path.insert(0, _watcher)


def _unwatch() -> None:
    if _watcher in sys.meta_path:
        sys.meta_path.remove(_watcher)
