"""Hooks on the exchanges that other libraries make among themselves, without handoff.

While a trace asks for them (``handoff-trace run``, ``HANDOFF_TRACE``, ``handoff.trace(libraries=True)``)
or the ordering mode is on (``handoff-trace run --order``, ``HANDOFF_ORDER=1``,
:func:`order_libraries`), the consumer functions of the known libraries (``torch.from_dlpack``,
``cupy.asarray``, ...) are wrapped as each library is imported, and so is the ``__dlpack__`` of
their array classes where Python lets it (to see the ``stream`` the consumer passes). Each wrapped
call records one event: producer and consumer libraries, protocol, data, streams, the user's line.
In the ordering mode the consumer's current stream first waits for the producer's (a pooled event,
never a host wait), and the producer is kept until the consumer's array is gone and its stream is
done with the memory. With neither asked for, nothing is wrapped.

A library handoff does not know is described by a :class:`LibraryAdapter` and
:func:`register_library`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import _handoff

__all__ = ["LibraryAdapter", "order_libraries", "register_library"]

_CPU = 1


@dataclasses.dataclass(frozen=True)
class LibraryAdapter:
    """What handoff needs to know of an array library to see, and order, its exchanges.

    Args:
        name: The library's name in traces, and the module prefix of its array types
            (``"torch"``, ``"cuda.core"``).
        consumers: Functions whose first argument is the array they import, as ``"module:attr"``
            (``"torch:from_dlpack"``, ``"cupy:asarray"``). Wrapped when ``module`` is imported.
        interface_first: Those of `consumers` that read the CUDA Array Interface before DLPack
            (``"cupy:asarray"``, numba's), so that the trace names the protocol they used.
        producers: Array classes, as ``"module:Class"``, whose ``__dlpack__`` is wrapped to see the
            ``stream`` a consumer passes (only classes defined in Python can be).
        current_stream: The library's current stream on a device, as a DLPack stream value (``1``
            for CUDA's legacy default stream), or None when it has none; called with the device id.
        use_stream: A context manager that makes a native stream handle (of the device given
            second) the library's current stream, for ``handoff.stream(s, frameworks=True)``; it
            returns None where the library has no current stream to set (a CPU build).
        ignores_stream: Its arrays' ``__dlpack__`` ignore the ``stream`` argument (they never order
            for the consumer).
    """

    name: str
    consumers: Sequence[str] = ()
    interface_first: Sequence[str] = ()
    producers: Sequence[str] = ()
    current_stream: Callable[[int], int | None] | None = None
    use_stream: Callable[[int, int], contextlib.AbstractContextManager[Any] | None] | None = None
    ignores_stream: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a library adapter needs a name (a non-empty str), not {self.name!r}")
        for kind in ("consumers", "interface_first", "producers"):
            targets = getattr(self, kind)
            if isinstance(targets, str):
                raise TypeError(f"{kind} must be a sequence of 'module:attr' strings, not one string")
            for target in targets:
                if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
                    raise ValueError(f"{kind} entry {target!r} is not 'module:attr'")
            object.__setattr__(self, kind, tuple(targets))
        unknown = set(self.interface_first) - set(self.consumers)
        if unknown:
            raise ValueError(f"interface_first names {sorted(unknown)}, which are not among the consumers")


# --- the known libraries ---------------------------------------------------------------------------


def _dlpack_value(handle: int, *, rocm: bool) -> int:
    """A native stream handle as DLPack numbers it: CUDA's legacy default stream (0) is 1; ROCm's
    default stream is 0 in both."""
    return 1 if handle == 0 and not rocm else handle


def _torch_stream(device: int) -> int | None:
    torch = sys.modules["torch"]
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    handle = int(torch.cuda.current_stream(device).cuda_stream)
    return _dlpack_value(handle, rocm=torch.version.hip is not None)


def _torch_use(handle: int, device: int) -> contextlib.AbstractContextManager[Any] | None:
    torch = sys.modules["torch"]
    if not torch.cuda.is_available():  # a CPU build: no current stream to set
        return None
    block: contextlib.AbstractContextManager[Any] = torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device))
    return block


def _cupy_stream(device: int) -> int | None:
    cupy = sys.modules["cupy"]
    with cupy.cuda.Device(device):
        handle = int(cupy.cuda.get_current_stream().ptr)
    return _dlpack_value(handle, rocm=bool(cupy.cuda.runtime.is_hip))


def _cupy_use(handle: int, device: int) -> contextlib.AbstractContextManager[Any] | None:
    cupy = sys.modules["cupy"]
    stream: contextlib.AbstractContextManager[Any] = cupy.cuda.ExternalStream(handle, device)
    return stream


def _numba_stream(device: int) -> int | None:
    """numba-cuda has no current stream: work with no stream goes to the default stream."""
    per_thread = os.environ.get("NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
    return 2 if per_thread else 1


KNOWN_LIBRARIES: tuple[LibraryAdapter, ...] = (
    LibraryAdapter("numpy", consumers=("numpy:from_dlpack",)),
    LibraryAdapter(
        "torch",
        consumers=("torch:from_dlpack", "torch.utils.dlpack:from_dlpack"),
        producers=("torch:Tensor",),
        current_stream=_torch_stream,
        use_stream=_torch_use,
    ),
    LibraryAdapter(
        "cupy",
        consumers=("cupy:from_dlpack", "cupy:asarray"),
        interface_first=("cupy:asarray",),
        current_stream=_cupy_stream,
        use_stream=_cupy_use,
    ),
    # JAX has no current stream, and its arrays order nothing for a consumer's stream.
    LibraryAdapter("jax", consumers=("jax.dlpack:from_dlpack", "jax.numpy:from_dlpack")),
    LibraryAdapter(
        "numba",
        consumers=("numba.cuda:as_cuda_array", "numba.cuda:from_cuda_array_interface"),
        interface_first=("numba.cuda:as_cuda_array", "numba.cuda:from_cuda_array_interface"),
        producers=("numba.cuda.cudadrv.devicearray:DeviceNDArray",),
        current_stream=_numba_stream,
    ),
    # Producers known to ignore `stream`: they never order for the consumer.
    LibraryAdapter("cuda.core", ignores_stream=True),
    LibraryAdapter("mlx", ignores_stream=True),
    LibraryAdapter("tvm_ffi", ignores_stream=True),
)

_registry: dict[str, LibraryAdapter] = {adapter.name: adapter for adapter in KNOWN_LIBRARIES}


def register_library(adapter: LibraryAdapter) -> None:
    """Teaches handoff's hooks a library it does not know (or replaces what it knows of one).

    Its consumer functions and producer classes are wrapped while hooks are in place (tracing other
    libraries, or the ordering mode), at once for a module already imported.
    """
    if not isinstance(adapter, LibraryAdapter):
        raise TypeError(f"register_library takes a handoff.LibraryAdapter, not {type(adapter).__name__}")
    with _lock:
        previous = _registry.get(adapter.name)
        if previous is not None and _users:
            _unpatch(previous)
        _registry[adapter.name] = adapter
        _library_of_type.clear()
        global _targets  # noqa: PLW0603
        _targets = None
        if _users:
            for module in {target.split(":")[0] for target in (*adapter.consumers, *adapter.producers)}:
                if module in sys.modules:
                    _patch_module(module)


def _adapter_of(value: Any) -> tuple[str | None, LibraryAdapter | None]:
    """The library of an array (the adapter whose name is the longest prefix of its type's module,
    else the module's top-level package) and its adapter, if any; remembered per type."""
    kind = type(value)
    known = _library_of_type.get(kind)
    if known is None:
        known = _library_of_type[kind] = _find_adapter(kind)
    return known


# Per array type, its library: cleared when an adapter is registered.
_library_of_type: dict[type, tuple[str | None, LibraryAdapter | None]] = {}


def _find_adapter(kind: type) -> tuple[str | None, LibraryAdapter | None]:
    module = getattr(kind, "__module__", None)
    if not isinstance(module, str) or module == "builtins":
        return None, None
    best: LibraryAdapter | None = None
    for adapter in _registry.values():
        if (module == adapter.name or module.startswith(adapter.name + ".")) and (
            best is None or len(adapter.name) > len(best.name)
        ):
            best = adapter
    if best is not None:
        return best.name, best
    top = module.split(".", 1)[0]
    owner = _PACKAGE_OF_LIBRARY.get(top)
    return (owner, _registry.get(owner)) if owner is not None else (top, None)


# Packages whose arrays belong to another library's name: JAX's arrays are jaxlib's types.
_PACKAGE_OF_LIBRARY = {"jaxlib": "jax"}


def _tracing() -> bool:
    """Whether a trace wants the hooks' events (not only the ordering mode)."""
    return _users > (1 if _ordering else 0)


def _made_by_nanobind(value: Any) -> bool:
    """nanobind's ndarray exports ignore `stream`; its types' metaclass is nanobind's ``nb_type``."""
    return type(type(value)).__name__.startswith("nb_type")


# --- installing the hooks --------------------------------------------------------------------------

_lock = threading.RLock()
_users = 0  # traces that want the hooks, plus one while the ordering mode is on
_ordering = False
# What was replaced, to put back: (owner, attribute) -> the original.
_replaced: dict[tuple[Any, str], Any] = {}


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of a module that a hook targets, to patch it once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _target_modules():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The module's own loader, as seen from inside it (pkgutil, importlib.resources).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with _lock:
            if _users:
                _patch_module(module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_finder = _Finder()


def _target_modules() -> frozenset[str]:
    """The modules the hooks patch: asked at every import while hooks are in place, so remembered
    until an adapter is registered."""
    global _targets  # noqa: PLW0603
    if _targets is None:
        _targets = frozenset(
            target.split(":")[0] for a in _registry.values() for target in (*a.consumers, *a.producers)
        )
    return _targets


_targets: frozenset[str] | None = None


def _resolve(target: str) -> tuple[Any, str, Any] | None:
    """(owner, attribute, value) of a ``module:attr`` target whose module is imported."""
    module_name, attribute = target.split(":")
    owner = sys.modules.get(module_name)
    if owner is None:
        return None
    value = getattr(owner, attribute, None)
    return None if value is None else (owner, attribute, value)


def _patch_module(module_name: str) -> None:
    for adapter in _registry.values():
        for target in adapter.consumers:
            if target.split(":")[0] == module_name:
                interface_first = target in adapter.interface_first
                _patch(target, functools.partial(_consumer_hook, consumer=adapter, interface_first=interface_first))
        if _tracing():  # the stream a consumer passes matters to a trace only
            for target in adapter.producers:
                if target.split(":")[0] == module_name:
                    _patch_producer(target)


def _patch(target: str, make: Callable[[Any], Any]) -> None:
    found = _resolve(target)
    if found is None:
        return
    owner, attribute, value = found
    if (owner, attribute) in _replaced or not callable(value) or isinstance(value, type):
        return  # done already; or a class, which a function must not replace (isinstance would break)
    _replaced[(owner, attribute)] = value
    setattr(owner, attribute, make(value))


def _patch_producer(target: str) -> None:
    found = _resolve(target)
    if found is None or not isinstance(found[2], type):
        return
    cls = found[2]
    original = cls.__dict__.get("__dlpack__")
    if original is None or (cls, "__dlpack__") in _replaced:
        return
    try:
        setattr(cls, "__dlpack__", _producer_hook(original))  # noqa: B010 - a class's attribute, replaced
    except (TypeError, AttributeError):  # an extension type: its stream argument stays unseen
        return
    _replaced[(cls, "__dlpack__")] = original


def _unpatch(adapter: LibraryAdapter | None = None, *, producers_only: bool = False) -> None:
    for (owner, attribute), original in list(_replaced.items()):
        if producers_only and not isinstance(owner, type):
            continue
        if adapter is not None:
            name = owner.__name__ if isinstance(owner, types.ModuleType) else owner.__module__
            if not any(t.split(":")[0] == name for t in (*adapter.consumers, *adapter.producers)):
                continue
        with contextlib.suppress(TypeError, AttributeError):
            setattr(owner, attribute, original)
        del _replaced[(owner, attribute)]


def acquire() -> None:
    """Puts the hooks in place (counted: each acquire needs its release)."""
    global _users  # noqa: PLW0603
    with _lock:
        _users += 1
        if _users == 1:
            sys.meta_path.insert(0, _finder)
        # Again when a trace joins the ordering mode: the producers' hooks are a trace's.
        for module in _target_modules():
            if module in sys.modules:
                _patch_module(module)


def release() -> None:
    """Takes the hooks away once no trace and no ordering mode needs them."""
    global _users  # noqa: PLW0603
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_finder)
            _unpatch()
        elif not _tracing():  # the ordering mode alone
            _unpatch(producers_only=True)


def order_libraries(enabled: bool = True) -> None:
    """Turns the ordering of exchanges between other libraries on or off, for the whole process.

    While on, each exchange that handoff's hooks see (``torch.from_dlpack(cupy_array)``,
    ``cupy.asarray(numba_array)``, ...) makes the consumer's current stream wait for the producer's
    (a pooled event, never a host wait), and keeps the producer until the consumer's array is gone
    and its stream is done with the memory. Traces mark those exchanges ``interposed="ordered"``.
    ``HANDOFF_ORDER=1`` and ``handoff-trace run --order`` turn it on at start.
    """
    global _ordering  # noqa: PLW0603
    with _lock:
        if bool(enabled) == _ordering:
            return
        _ordering = bool(enabled)
    if _ordering:
        acquire()
    else:
        release()


# --- one exchange --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Exchange:
    argument: Any
    device: tuple[int, int]
    stream_argument: int | None = None
    producer_device: int | None = None  # the device current when the producer's __dlpack__ ran


_local = threading.local()


def _current() -> _Exchange | None:
    exchange: _Exchange | None = getattr(_local, "exchange", None)
    return exchange


def _producer_hook(original: Any) -> Any:
    @functools.wraps(original)
    def __dlpack__(self: Any, *args: Any, **kwargs: Any) -> Any:
        exchange = _current()
        if exchange is not None and exchange.argument is self:
            stream = kwargs.get("stream", args[0] if args else None)
            exchange.stream_argument = stream if isinstance(stream, int) and not isinstance(stream, bool) else None
            if exchange.device[0] != _CPU:
                # A producer orders the streams of the device current when it is called.
                exchange.producer_device = _handoff._interposed_current_device(exchange.device[0])
        return original(self, *args, **kwargs)

    return __dlpack__


def _consumer_hook(original: Any, consumer: LibraryAdapter, interface_first: bool) -> Any:
    @functools.wraps(original)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        if not args or _current() is not None:  # the outermost call of a nest is the exchange
            return original(*args, **kwargs)
        return _exchange(original, consumer, interface_first, args, kwargs)

    hooked.__handoff_original__ = original  # type: ignore[attr-defined]
    return hooked


def _protocol_of(value: Any, interface_first: bool) -> str | None:
    """The protocol a consumer reads `value` through; None when it has neither (not an exchange)."""
    if isinstance(value, type):
        return None
    order = (
        ("__cuda_array_interface__", "__dlpack__") if interface_first else ("__dlpack__", "__cuda_array_interface__")
    )
    for attribute in order:
        if hasattr(value, attribute):
            return "dlpack" if attribute == "__dlpack__" else "cuda-array-interface"
    return None


def _device_of(value: Any, protocol: str) -> tuple[int, int] | None:
    try:
        if protocol == "dlpack":
            device = value.__dlpack_device__()
            return (int(device[0]), int(device[1]))
        pointer = int(value.__cuda_array_interface__["data"][0])
    except Exception:  # noqa: BLE001 - the consumer's own call will say what is wrong
        return None
    found = _handoff._interposed_device(pointer)
    return None if found is None else (int(found[0]), int(found[1]))


def _stream_of(adapter: LibraryAdapter | None, device: tuple[int, int]) -> int | None:
    if adapter is None or adapter.current_stream is None or device[0] == _CPU:
        return None
    try:
        stream = adapter.current_stream(device[1])
    except Exception:  # noqa: BLE001 - a library that cannot say: the trace names no stream
        return None
    return None if stream is None else int(stream)


def _interface_stream(value: Any) -> int | None:
    with contextlib.suppress(Exception):
        stream = value.__cuda_array_interface__.get("stream")
        return None if stream is None else int(stream)
    return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _handoff._log_warning(message)


def _describe(result: Any, argument: Any) -> tuple[list[int], str, int]:
    """Shape, dtype name and bytes of the data, read from the consumer's array (else the producer's)."""
    for value in (result, argument):
        try:
            shape = [int(n) for n in value.shape]
            dtype = _dtype_name(value.dtype)
            nbytes = int(value.nbytes)
        except Exception:  # noqa: BLE001 - not array-like: try the other
            continue
        return shape, dtype, nbytes
    return [], "", 0


_dtype_names: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """``"float32"`` for NumPy's, PyTorch's (``torch.float32``), CuPy's and JAX's float32; remembered
    per dtype (NumPy's ``str`` of a dtype costs microseconds)."""
    try:
        return _dtype_names[dtype]
    except KeyError:
        name = _dtype_names[dtype] = str(dtype).rsplit(".", 1)[-1]
        return name
    except TypeError:  # not hashable
        return str(dtype).rsplit(".", 1)[-1]


def _exchange(
    original: Any, consumer: LibraryAdapter, interface_first: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    argument = args[0]
    producer_name, producer = _adapter_of(argument)
    protocol = _protocol_of(argument, interface_first)
    if protocol is None or producer_name in (None, consumer.name, "handoff"):
        # Not an exchange (a list, a host array read through __array__), one within a library, or
        # one handoff records itself.
        return original(*args, **kwargs)
    assert producer_name is not None
    device = _device_of(argument, protocol) or (_CPU, 0)
    tracing = _tracing()
    if not tracing and device[0] == _CPU:  # the ordering mode alone: host data needs nothing
        return original(*args, **kwargs)
    consumer_stream = _stream_of(consumer, device)
    producer_stream = _interface_stream(argument) if protocol != "dlpack" else None
    if producer_stream is None:
        producer_stream = _stream_of(producer, device)
    ignores = (producer is not None and producer.ignores_stream) or _made_by_nanobind(argument)
    ordered = False
    if _ordering and device[0] != _CPU and consumer_stream is not None and producer_stream is not None:
        try:
            ordered = bool(_handoff._interposed_order(device, producer_stream, consumer_stream))
        except Exception as error:  # noqa: BLE001 - the program runs as it would without the ordering mode
            _warn_once(f"handoff could not order an exchange from {producer_name} to {consumer.name}: {error}")

    seen = _Seen(protocol, producer_name, consumer.name, device, producer_stream, consumer_stream)
    exchange = _Exchange(argument, device)
    _local.exchange = exchange
    # A producer or consumer built on handoff exchanges through it inside: this event covers those.
    _handoff._interposed_mute(True)
    try:
        result = original(*args, **kwargs)
    except BaseException as error:
        _local.exchange = None
        _handoff._interposed_mute(False)
        seen.record("import", exchange.stream_argument, "refused", ordered, f"{type(error).__name__}: {error}"[:200])
        raise
    _local.exchange = None
    _handoff._interposed_mute(False)

    if ordered:
        _keep_until_done(result, argument, device, consumer_stream)
    if not tracing:
        return result
    seen.shape, seen.dtype, seen.nbytes = _describe(result, argument)
    hazard = ""
    if exchange.producer_device is not None and exchange.producer_device != device[1]:
        hazard = "cross-device"
        detail = (
            f"the producer's __dlpack__ ran while device {exchange.producer_device} was current: it ordered that "
            f"device's streams, not those of device {device[1]}, where the data is"
        )
        action = "unordered"
    else:
        action, detail = _action(
            protocol, device, exchange.stream_argument, ignores, ordered, producer_stream, consumer_stream
        )
    seen.record("import", exchange.stream_argument, action, ordered, detail, hazard)
    if not ordered and device[0] != _CPU and consumer_stream is not None:
        _watch_release(result, argument, seen)
    return result


@dataclasses.dataclass
class _Seen:
    """What an exchange's events say of it."""

    protocol: str
    producer: str
    consumer: str
    device: tuple[int, int]
    producer_stream: int | None
    consumer_stream: int | None
    shape: list[int] = dataclasses.field(default_factory=list)
    dtype: str = ""
    nbytes: int = 0

    def record(
        self, kind: str, stream_argument: int | None, action: str, ordered: bool, detail: str, hazard: str = ""
    ) -> None:
        with contextlib.suppress(Exception):  # tracing never breaks the program
            _handoff._interposed_record(
                kind,
                self.protocol,
                self.producer,
                self.consumer,
                self.device,
                self.shape,
                self.dtype,
                self.nbytes,
                self.producer_stream,
                self.consumer_stream,
                stream_argument,
                action,
                ordered,
                hazard,
                detail,
            )


def _watch_release(result: Any, argument: Any, seen: _Seen) -> None:
    """Flags `released early` when the consumer's array goes while its stream still has work queued and
    nothing else holds the producer: its memory then goes back to its library, which may hand it out
    again while that work still reads it. Producers that take no weak reference are not watched."""
    try:
        producer = weakref.ref(argument)
        weakref.finalize(result, _check_release, producer, seen)
    except TypeError:
        return


# References to a producer held while its consumer's array goes: the check's own and getrefcount's,
# and the one the consumer's capsule gives up next.
_ONLY_THE_CONSUMERS = 3


def _check_release(producer: weakref.ref[Any], seen: _Seen) -> None:
    held = producer()
    if held is None or sys.getrefcount(held) > _ONLY_THE_CONSUMERS:
        return  # gone already, or kept by someone else: its memory stays
    del held
    assert seen.consumer_stream is not None
    if _handoff._interposed_stream_busy(seen.device, seen.consumer_stream):
        seen.record(
            "release",
            None,
            "unordered",
            False,
            f"the {seen.consumer} array was dropped while its stream {seen.consumer_stream:#x} still had work "
            f"queued, and with it the last reference to the {seen.producer} array: its memory may be reused before "
            "that work reads it",
            "released early",
        )


def _action(
    protocol: str,
    device: tuple[int, int],
    stream_argument: int | None,
    ignores: bool,
    ordered: bool,
    producer_stream: int | None,
    consumer_stream: int | None,
) -> tuple[str, str]:
    """How the consumer's stream was ordered after the producer's, and why, in words."""
    if device[0] == _CPU:
        return "none", ""
    if ordered:
        return "wait", "ordered by handoff: the consumer's stream waits for the producer's"
    if producer_stream is not None and producer_stream == consumer_stream:
        return "elided", "the producer's and the consumer's current streams are the same"
    if protocol == "cuda-array-interface":
        if producer_stream is None:
            return "unordered", "CUDA Array Interface data without a stream: nothing orders its producer's work"
        return "wait", "the consumer synchronizes the interface's stream"
    if ignores:
        return "unordered", "the producer ignores DLPack's stream argument: it orders nothing for the consumer"
    if stream_argument == -1:
        return "unordered", "the consumer passed stream=-1: it asked for no ordering"
    return "wait", ""


def _keep_until_done(result: Any, argument: Any, device: tuple[int, int], consumer_stream: int | None) -> None:
    """Keeps the producer until the consumer's array is gone and its stream is done with the memory."""
    if consumer_stream is None:
        return
    with contextlib.suppress(TypeError):  # an array that takes no weak reference: its owner decides
        weakref.finalize(result, _handoff._interposed_keep, argument, device, consumer_stream)


# --- one stream for every framework --------------------------------------------------------------


@contextlib.contextmanager
def frameworks_on(handle: int, device: int) -> Iterator[list[str]]:
    """Makes a native stream handle the current stream of every imported library that has one
    (PyTorch, CuPy and registered libraries with ``use_stream``); yields their names."""
    with contextlib.ExitStack() as stack:
        names = []
        for adapter in list(_registry.values()):
            module = adapter.name.split(".", 1)[0]
            if adapter.use_stream is None or module not in sys.modules:
                continue
            block = adapter.use_stream(handle, device)
            if block is not None:
                stack.enter_context(block)
                names.append(adapter.name)
        yield names
