"""What handoff knows of other array libraries: their consumer functions, their array classes, their
current streams. Read by the hooks on their exchanges (handoff._interpose) and by
``handoff.stream(s, frameworks=True)``.

A library handoff does not know is described by a :class:`LibraryAdapter` and
:func:`handoff.register_library`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from . import _handoff

__all__ = ["KNOWN_LIBRARIES", "LibraryAdapter", "Target", "frameworks_on", "registry", "stream_owner"]


class Target(NamedTuple):
    """A function or class named ``"module:attr"``, and for a consumer function, the name of the
    parameter that takes the array when Python cannot read it from the function (``"module:attr(name)"``:
    a C or Cython function without a signature)."""

    module: str
    attribute: str
    parameter: str | None = None

    @classmethod
    def parse(cls, text: str, kind: str) -> Target:
        name, parameter = text, None
        if text.endswith(")") and "(" in text:
            name, _, rest = text.partition("(")
            parameter = rest[:-1]
            if not parameter.isidentifier():
                raise ValueError(f"{kind} entry {text!r}: {parameter!r} is not a parameter name")
        module, colon, attribute = name.partition(":")
        if not colon or not module or not attribute or ":" in attribute:
            raise ValueError(f"{kind} entry {text!r} is not 'module:attr'")
        return cls(module, attribute, parameter)


@dataclasses.dataclass(frozen=True)
class LibraryAdapter:
    """What handoff needs to know of an array library to see, and order, its exchanges.

    Args:
        name: The library's name in traces, and the module prefix of its array types
            (``"torch"``, ``"cuda.core"``).
        consumers: Functions that import an array given as their first argument (or by keyword), as
            ``"module:attr"`` (``"torch:from_dlpack"``, ``"cupy:asarray"``); wrapped when ``module`` is
            imported. The array's parameter is read from the function's signature; for a C or Cython
            function that has none, name it: ``"cupy:from_dlpack(array)"``.
        interface_first: Those of `consumers` that read the CUDA Array Interface before DLPack
            (``"cupy:asarray"``, numba's), so that the trace names the protocol they used.
        producers: Array classes, as ``"module:Class"``, whose ``__dlpack__`` is wrapped to see the
            ``stream`` a consumer passes (only classes defined in Python can be).
        current_stream: The library's current stream on a device, called with the device id: a stream
            object (anything :func:`handoff.as_stream` takes; handoff holds it while it orders with it,
            so that a stream the library destroys with its object stays alive until then), a DLPack
            stream value (an int: ``1`` for CUDA's legacy default stream), or None when it has none.
        use_stream: A context manager that makes a native stream handle the library's current
            stream, for ``handoff.stream(s, frameworks=True)``; called with the handle and the
            stream's device (None where handoff cannot tell: the library's current device). It returns
            None where the library has no current stream to set (a CPU build).
        ignores_stream: Its arrays' ``__dlpack__`` ignore the ``stream`` argument (they never order
            for the consumer).
        device: One of its arrays' DLPack device, ``(device_type, device_id)``, exactly as the
            array's ``__dlpack_device__`` answers, for libraries where asking that costs more than it
            need (PyTorch's is Python): the hooks ask it instead, once per exchange. None: the array
            is asked.
        host_only: Its arrays are host data, whatever the array (NumPy's): the ordering mode alone
            passes their exchanges through without asking their device.
    """

    name: str
    consumers: Sequence[str] = ()
    interface_first: Sequence[str] = ()
    producers: Sequence[str] = ()
    current_stream: Callable[[int], object] | None = None
    use_stream: Callable[[int, int | None], contextlib.AbstractContextManager[Any] | None] | None = None
    ignores_stream: bool = False
    device: Callable[[Any], tuple[int, int]] | None = None
    host_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a library adapter needs a name (a non-empty str), not {self.name!r}")
        if self.device is not None and not callable(self.device):
            raise TypeError(f"device must be a function of an array, or None, not {type(self.device).__name__}")
        if not isinstance(self.host_only, bool):
            raise TypeError(f"host_only must be a bool, not {type(self.host_only).__name__}")
        for kind in ("consumers", "interface_first", "producers"):
            given = getattr(self, kind)
            if isinstance(given, str):
                raise TypeError(f"{kind} must be a sequence of 'module:attr' strings, not one string")
            entries = tuple(given)  # once: a generator is read once
            for entry in entries:
                if not isinstance(entry, str):
                    raise ValueError(f"{kind} entry {entry!r} is not 'module:attr'")
                target = Target.parse(entry, kind)
                if target.parameter is not None and kind != "consumers":
                    raise ValueError(f"{kind} entry {entry!r}: only consumers name a parameter")
            object.__setattr__(self, kind, entries)
        unknown = {_function(t) for t in self.interface_first} - {_function(t) for t in self.consumers}
        if unknown:
            raise ValueError(f"interface_first names {sorted(unknown)}, which are not among the consumers")

    def consumer_targets(self) -> Iterator[tuple[Target, bool]]:
        """Each consumer function, and whether it reads the CUDA Array Interface first."""
        first = {_function(t) for t in self.interface_first}
        for entry in self.consumers:
            yield Target.parse(entry, "consumers"), _function(entry) in first

    def producer_targets(self) -> Iterator[Target]:
        """Each producer class."""
        for entry in self.producers:
            yield Target.parse(entry, "producers")

    def modules(self) -> set[str]:
        """The modules whose import its hooks wait for."""
        return {t.module for t, _ in self.consumer_targets()} | {t.module for t in self.producer_targets()}


def _function(entry: str) -> str:
    """A consumer entry without its parameter: ``"cupy:from_dlpack"``."""
    return entry.partition("(")[0]


# --- the known libraries ---------------------------------------------------------------------------

_DL_CPU, _DL_CUDA_HOST = 1, 3  # DLPack's kDLCPU, kDLCUDAHost


def _torch_stream(device: int) -> object:
    """PyTorch's current stream: its own (the default stream, its pool's) live as long as the process,
    and are given as their objects; an external one (``torch.cuda.ExternalStream``, whose ``stream_id``
    is its even handle, as c10's CUDAStream numbers them) is another's, and is given as a bare handle."""
    torch = sys.modules["torch"]
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    stream = torch.cuda.current_stream(device)
    external = stream.stream_id != 0 and stream.stream_id % 2 == 0
    return int(stream.cuda_stream) if external else stream


def _torch_use(handle: int, device: int | None) -> contextlib.AbstractContextManager[Any] | None:
    torch = sys.modules["torch"]
    if not torch.cuda.is_available():  # a CPU build: no current stream to set
        return None
    block: contextlib.AbstractContextManager[Any] = torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device))
    return block


def _torch_device(tensor: Any) -> tuple[int, int]:
    """A tensor's DLPack device as ``Tensor.__dlpack_device__`` answers (torch/_tensor.py, PyTorch
    2.13), at a tenth of its cost for a plain CPU tensor (it is Python, imports its enum and reads
    the device's type through a string each call): kDLCPU, or kDLCUDAHost when pinned. A subclass
    (which may answer through ``__torch_function__``) and device data are asked."""
    if type(tensor) is sys.modules["torch"].Tensor and tensor.is_cpu:
        return (_DL_CUDA_HOST if tensor.is_pinned() else _DL_CPU, 0)
    device: tuple[int, int] = tensor.__dlpack_device__()
    return device


def _cupy_stream(device: int) -> object:
    """CuPy's current stream object, which destroys its stream when it goes."""
    return sys.modules["cupy"].cuda.get_current_stream(device)


def _cupy_use(handle: int, device: int | None) -> contextlib.AbstractContextManager[Any] | None:
    cupy = sys.modules["cupy"]
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14 deprecates ExternalStream for it
        from ._streams import Stream

        stream: contextlib.AbstractContextManager[Any] = cupy.cuda.Stream.from_external(Stream(handle, device=device))
        return stream
    return cupy.cuda.ExternalStream(handle, -1 if device is None else device)  # type: ignore[no-any-return]


def _numba_stream(device: int) -> object:
    """numba-cuda has no current stream: work with no stream goes to the default stream (a DLPack value)."""
    per_thread = os.environ.get("NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
    return 2 if per_thread else 1


KNOWN_LIBRARIES: tuple[LibraryAdapter, ...] = (
    LibraryAdapter("numpy", consumers=("numpy:from_dlpack",), host_only=True),
    LibraryAdapter(
        "torch",
        consumers=("torch:from_dlpack", "torch.utils.dlpack:from_dlpack"),
        producers=("torch:Tensor",),
        current_stream=_torch_stream,
        use_stream=_torch_use,
        device=_torch_device,
    ),
    LibraryAdapter(
        "cupy",
        # Cython functions without a signature (CuPy builds with binding=False): the parameter named.
        consumers=("cupy:from_dlpack(array)", "cupy:asarray"),
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

# Packages whose arrays belong to another library's name: JAX's arrays are jaxlib's types.
_PACKAGE_OF_LIBRARY = {"jaxlib": "jax"}


class _Registry:
    """The adapters by name, and what is derived from them: each array type's library, the modules
    the hooks wait for."""

    def __init__(self, adapters: Iterable[LibraryAdapter]) -> None:
        self._lock = threading.Lock()
        self._adapters = {adapter.name: adapter for adapter in adapters}

    def get(self, name: str) -> LibraryAdapter | None:
        return self._adapters.get(name)

    def adapters(self) -> list[LibraryAdapter]:
        return list(self._adapters.values())

    def add(self, adapter: LibraryAdapter) -> LibraryAdapter | None:
        """Adds or replaces `adapter`; the one it replaced, if any."""
        with self._lock:
            previous = self._adapters.get(adapter.name)
            self._adapters[adapter.name] = adapter
            _handoff._interposed_forget_libraries()
        return previous

    def remove(self, name: str) -> LibraryAdapter | None:
        """Forgets the adapter named `name`; the one it forgot, if any."""
        with self._lock:
            removed = self._adapters.pop(name, None)
            _handoff._interposed_forget_libraries()
        return removed

    def modules(self) -> set[str]:
        return set().union(*(adapter.modules() for adapter in self.adapters()))

    def find(self, kind: type) -> tuple[str | None, LibraryAdapter | None]:
        """The library of an array type (the adapter whose name is the longest prefix of its module,
        else the module's top-level package) and its adapter, if any. The hooked consumers' calls
        remember it per type until an adapter is added or removed."""
        module = getattr(kind, "__module__", None)
        if not isinstance(module, str) or module == "builtins":
            return None, None
        best: LibraryAdapter | None = None
        for adapter in self.adapters():
            if (module == adapter.name or module.startswith(adapter.name + ".")) and (
                best is None or len(adapter.name) > len(best.name)
            ):
                best = adapter
        if best is not None:
            return best.name, best
        top = module.split(".", 1)[0]
        owner = _PACKAGE_OF_LIBRARY.get(top)
        return (owner, self._adapters.get(owner)) if owner is not None else (top, None)

    def imported(self) -> Iterator[LibraryAdapter]:
        """The adapters of the libraries imported now."""
        for adapter in self.adapters():
            if adapter.name.split(".", 1)[0] in sys.modules:
                yield adapter


registry = _Registry(KNOWN_LIBRARIES)


# --- what keeps a library's stream alive ------------------------------------------------------------


def stream_owner(handle: int, device: int) -> object:
    """The stream object of an imported library whose current stream on `device` is native stream
    `handle` (a consumer passes its current stream to ``__dlpack__``: CuPy, PyTorch), which keeps it
    alive while a release waits for it; a JAX device for one of JAX's streams, which live as long as
    its client; None when no library says so."""
    for adapter in registry.imported():
        if adapter.current_stream is None:
            continue
        try:
            stream = adapter.current_stream(device)
            if stream is not None and not isinstance(stream, int) and _handoff._resolve_stream(stream)[0] == handle:
                return stream
        except Exception:  # noqa: BLE001 - an adapter that cannot say holds nothing
            continue
    return _jax_stream_owner(handle, device)


def _jax_stream_owner(handle: int, device: int) -> object:
    """JAX passes the stream its imports are ordered after (its device's
    ``get_stream_for_external_ready_events()``, jax/_src/dlpack.py): the device holds its client,
    whose streams live as long as it does."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        for found in jax.local_devices():
            if found.platform in ("gpu", "cuda", "rocm") and found.local_hardware_id == device:
                return found if found.get_stream_for_external_ready_events() == handle else None
    except Exception:  # noqa: BLE001 - a JAX that cannot say holds nothing
        return None
    return None


_handoff._set_stream_owner_lookup(stream_owner)


# --- one stream for every framework ----------------------------------------------------------------


@contextlib.contextmanager
def frameworks_on(handle: int, device: int | None) -> Iterator[list[str]]:
    """Makes a native stream handle the current stream of every imported library that has one
    (PyTorch, CuPy and registered libraries with ``use_stream``); yields their names. With no
    `device`, the stream's own (the backend is asked; a default stream's is the current device)."""
    if device is None:
        device = _handoff._interposed_stream_device(handle)
    with contextlib.ExitStack() as stack:
        names = []
        for adapter in registry.imported():
            if adapter.use_stream is None:
                continue
            block = adapter.use_stream(handle, device)
            if block is not None:
                stack.enter_context(block)
                names.append(adapter.name)
        yield names
