"""Post-import hooks: a function called with a module once it has been imported.

:func:`register` calls ``hook(module)`` at once when the module is imported already, and each time
it is executed from now on: when it is first imported, and again when it is reloaded
(``importlib.reload``, IPython's autoreload), which makes new function objects of the old names.
The finder only notifies; what a hook does with the module is the hook's business (compare wrapt's
post-import hooks). A hook that imports modules itself, a finder that imports while it looks, and a
module that imports itself while it runs are all safe: the finder steps aside for a name it is
already looking up on the same thread.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["register", "unregister"]

Hook = Callable[[types.ModuleType], None]

_lock = threading.RLock()
_hooks: dict[str, list[Hook]] = {}  # module name -> its hooks, in the order they were registered
_looking_up = threading.local()  # the names this thread's finder is looking up now


def register(name: str, hook: Hook) -> None:
    """Calls ``hook(module)`` each time module `name` is executed from now on, and at once when it is
    imported already. A hook that is registered twice is called twice."""
    with _lock:
        if not _hooks:
            sys.meta_path.insert(0, _finder)
        _hooks.setdefault(name, []).append(hook)
    module = sys.modules.get(name)
    if module is not None:
        hook(module)


def unregister(name: str, hook: Hook) -> None:
    """Stops calling `hook` for module `name` (once, for a hook registered twice)."""
    with _lock:
        hooks = _hooks.get(name, [])
        if hook in hooks:
            hooks.remove(hook)
        if not hooks:
            _hooks.pop(name, None)
        if not _hooks and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def _notify(module: types.ModuleType) -> None:
    with _lock:
        hooks = list(_hooks.get(module.__name__, ()))
    for hook in hooks:
        hook(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a hooked module through the other finders, and gives it a loader that notifies once the
    module has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _hooks:
            return None
        names: set[str] = _looking_up.__dict__.setdefault("names", set())
        if fullname in names:
            return None  # a finder looking it up imported it again: let the others answer
        names.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _NotifyingLoader(spec.loader)
                    return spec
            return None
        finally:
            names.discard(fullname)


class _NotifyingLoader(importlib.abc.Loader):
    """The module's own loader, which notifies the module's hooks once it has executed the module."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The module sees its own loader (pkgutil, importlib.resources ask it), not this one.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _notify(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_finder = _Finder()
