"""Hooks on the exchanges that other libraries make among themselves, without handoff.

While a trace asks for them (``handoff-trace run``, ``HANDOFF_TRACE``, ``handoff.trace(libraries=True)``)
or the ordering mode is on (``handoff-trace run --order``, ``HANDOFF_ORDER=1``,
:func:`order_libraries`), the consumer functions of the known libraries (``torch.from_dlpack``,
``cupy.asarray``, ...) are wrapped as each library is imported (and again when it is reloaded), and
so is the ``__dlpack__`` of their array classes where Python lets it (to see the ``stream`` the
consumer passes). Each wrapped call is one exchange (handoff._interposed). With neither asked for,
nothing is wrapped, and taking the hooks away puts back only what is still theirs: a function the
program replaced meanwhile stays.

What handoff knows of each library is in handoff._adapters; import hooks in handoff._import_hooks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from . import _handoff, _import_hooks, _interposed
from ._adapters import LibraryAdapter, Target, frameworks_on, registry

__all__ = ["LibraryAdapter", "frameworks_on", "order_libraries", "register_library"]


@dataclasses.dataclass
class _Installed:
    """A wrapper in place of `original`, as `attribute` of `owner` (a module, or a producer class)."""

    owner: Any
    attribute: str
    original: Any
    wrapper: Any

    def is_current(self) -> bool:
        """Whether the wrapper is still there: not replaced by a reload or by the program."""
        if isinstance(self.owner, type):
            return self.owner.__dict__.get(self.attribute) is self.wrapper
        return getattr(self.owner, self.attribute, None) is self.wrapper

    def put_back(self) -> None:
        if self.is_current():
            setattr(self.owner, self.attribute, self.original)


class _Hooks:
    """The hooks' state: who wants them, and what they replaced."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.traces = 0  # traces that want the hooks
        self.ordering = False
        self.installed: dict[tuple[int, str], _Installed] = {}  # by (id(owner), attribute)
        self.modules: set[str] = set()  # those with an import hook registered

    @property
    def wanted(self) -> bool:
        return self.traces > 0 or self.ordering

    # --- who wants them ---------------------------------------------------------------------------

    def acquire(self) -> None:
        with self.lock:
            self.traces += 1
            self._update()

    def release(self) -> None:
        with self.lock:
            if self.traces > 0:
                self.traces -= 1
                self._update()

    def set_ordering(self, enabled: bool) -> None:
        with self.lock:
            self.ordering = enabled
            self._update()

    def _update(self) -> None:
        """Hooks in place for each library while wanted; a producer's only while a trace wants them
        (the stream a consumer passes matters to a trace only)."""
        _handoff._interposed_set_mode(self.traces > 0, self.ordering)
        if not self.wanted:
            self._uninstall(lambda entry: True)
            for module in self.modules:
                _import_hooks.unregister(module, self._module_ran)
            self.modules.clear()
            return
        if not self.traces:
            self._uninstall(lambda entry: isinstance(entry.owner, type))
        self._watch(registry.modules())
        for module in list(self.modules):  # again when a trace joins the ordering mode: the producers'
            found = sys.modules.get(module)
            if found is not None:
                self._patch(found)

    def _watch(self, modules: set[str]) -> None:
        for module in modules - self.modules:
            self.modules.add(module)
            _import_hooks.register(module, self._module_ran)  # at once when it is imported already

    # --- a library -------------------------------------------------------------------------------

    def register(self, adapter: LibraryAdapter) -> None:
        with self.lock:
            previous = registry.add(adapter)
            if previous is not None:
                names = previous.modules()
                self._uninstall(lambda entry: _module_name(entry.owner) in names)
            if self.wanted:
                self._watch(adapter.modules())
                for module in adapter.modules():
                    found = sys.modules.get(module)
                    if found is not None:
                        self._patch(found)

    def _module_ran(self, module: types.ModuleType) -> None:
        """An import hook: the module was imported or reloaded."""
        with self.lock:
            if self.wanted:
                self._patch(module)

    def _patch(self, module: types.ModuleType) -> None:
        for adapter in registry.adapters():
            for target, interface_first in adapter.consumer_targets():
                if target.module == module.__name__:
                    self._install_consumer(module, target, adapter, interface_first)
            if self.traces:
                for target in adapter.producer_targets():
                    if target.module == module.__name__:
                        self._install_producer(module, target)

    def _install_consumer(
        self, module: types.ModuleType, target: Target, adapter: LibraryAdapter, interface_first: bool
    ) -> None:
        value = getattr(module, target.attribute, None)
        if value is None or not callable(value) or isinstance(value, type):
            return  # absent; or a class, which a function must not replace (isinstance would break)
        key = (id(module), target.attribute)
        if self._is_wrapper(value):
            # Ours, copied here while the hooks were in place (torch/__init__ takes torch.utils.dlpack's
            # from_dlpack): its wrapper is shared, so both stay one object, and its original is put
            # back here too when the hooks go.
            if key not in self.installed:
                original = next(entry.original for entry in self.installed.values() if entry.wrapper is value)
                self.installed[key] = _Installed(module, target.attribute, original, value)
            return
        wrapper = self._wrapper_of(value)
        if wrapper is None:
            consumer = _interposed.Consumer(adapter, interface_first, _array_parameter(value, target))
            wrapper = _consumer_wrapper(value, consumer)
        setattr(module, target.attribute, wrapper)
        self.installed[key] = _Installed(module, target.attribute, value, wrapper)
        _pickle_as_installed(wrapper, module, target.attribute)

    def _install_producer(self, module: types.ModuleType, target: Target) -> None:
        cls = getattr(module, target.attribute, None)
        if not isinstance(cls, type):
            return
        original = cls.__dict__.get("__dlpack__")
        if not callable(original) or self._is_wrapper(original):  # absent, or a descriptor this hook is not
            return
        wrapper = _handoff._interposed_producer_hook(original)
        try:
            setattr(cls, "__dlpack__", wrapper)  # noqa: B010 - a class's attribute, replaced
        except (TypeError, AttributeError):  # an extension type: its stream argument stays unseen
            return
        self.installed[(id(cls), "__dlpack__")] = _Installed(cls, "__dlpack__", original, wrapper)

    def _is_wrapper(self, value: Any) -> bool:
        return any(entry.wrapper is value for entry in self.installed.values())

    def _wrapper_of(self, original: Any) -> Any:
        """The wrapper of `original` in place elsewhere (an alias of it), if any."""
        for entry in self.installed.values():
            if entry.original is original and entry.is_current():
                return entry.wrapper
        return None

    def _uninstall(self, chosen: Callable[[_Installed], bool]) -> None:
        """Puts back the originals of the chosen wrappers that are still in place."""
        for key, entry in list(self.installed.items()):
            if chosen(entry):
                entry.put_back()
                del self.installed[key]


def _module_name(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, types.ModuleType) else str(owner.__module__)


def _array_parameter(function: Any, target: Target) -> str | None:
    """The name of the parameter that takes the array, when it may be given by keyword: the first
    of the signature Python reads, else the one the adapter names; None when only a positional array
    is seen."""
    try:
        first = next(iter(inspect.signature(function).parameters.values()), None)
    except (TypeError, ValueError):  # a C or Cython function without a signature
        return target.parameter
    if first is None or first.kind not in (first.POSITIONAL_OR_KEYWORD, first.KEYWORD_ONLY):
        return None
    return first.name


def _pickle_as_installed(wrapper: Any, module: types.ModuleType, attribute: str) -> None:
    """A function pickles as the module attribute its ``__module__`` and ``__qualname__`` name, which
    must be the function itself: the wrapper names a place where it is installed, so that it pickles
    as what it wraps (and unpickles as that, where no hooks are in place)."""
    qualname = getattr(wrapper, "__qualname__", None)  # none where the original had none to give
    home: Any = sys.modules.get(getattr(wrapper, "__module__", None) or "") if qualname else None
    for part in qualname.split(".") if qualname else ():
        home = getattr(home, part, None)
    if home is not wrapper:
        wrapper.__module__, wrapper.__qualname__ = module.__name__, attribute
        if not hasattr(wrapper, "__name__"):
            wrapper.__name__ = attribute


def _consumer_wrapper(original: Any, consumer: _interposed.Consumer) -> Any:
    """The hooked consumer: a C object called as the original is (no Python frame of its own), with
    the original's name, signature, documentation and attributes, as functools.wraps gives them."""
    call = _handoff._interposed_call(original, consumer, registry.find, _interposed.exchange, _interposed.not_recorded)
    functools.update_wrapper(call, original)
    call.__handoff_original__ = original  # type: ignore[attr-defined]
    return call


_hooks = _Hooks()


def acquire() -> None:
    """Puts the hooks in place for a trace (counted: each acquire needs its release)."""
    _hooks.acquire()


def release() -> None:
    """Takes the hooks away once no trace and no ordering mode needs them."""
    _hooks.release()


def register_library(adapter: LibraryAdapter) -> None:
    """Teaches handoff's hooks a library it does not know (or replaces what it knows of one).

    Its consumer functions and producer classes are wrapped while hooks are in place (tracing other
    libraries, or the ordering mode), at once for a module already imported.
    """
    if not isinstance(adapter, LibraryAdapter):
        raise TypeError(f"register_library takes a handoff.LibraryAdapter, not {type(adapter).__name__}")
    _hooks.register(adapter)


def order_libraries(enabled: bool = True) -> None:
    """Turns the ordering of exchanges between other libraries on or off, for the whole process.

    While on, each exchange that handoff's hooks see (``torch.from_dlpack(cupy_array)``,
    ``cupy.asarray(numba_array)``, ...) makes the consumer's current stream wait for the producer's
    (a pooled event, never a host wait), and hands the consumer handoff's import of the producer's
    array, whose release waits for the work the consumer's stream has when the consumer lets go of
    the data (its storage, which views share). Traces mark those exchanges ``interposed="ordered"``;
    one whose stream handoff cannot learn is flagged ``unordered``, saying why.
    ``HANDOFF_ORDER=1`` and ``handoff-trace run --order`` turn it on at start.
    """
    _hooks.set_ordering(bool(enabled))
