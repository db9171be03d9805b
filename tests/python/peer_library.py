"""Small array libraries on the simulated device that exchange as real peers do, without going
through handoff's hooks themselves: a current stream per library (a stream object, which the
library's adapter gives handoff, as CuPy's does: a stream object destroys its stream when it goes), and

- ``from_dlpack`` as PyTorch 2.13's ``torch.from_dlpack``: the producer's ``__dlpack_device__`` first,
  then its ``__dlpack__`` with ``max_version=(1, 0)`` and, for CUDA or ROCm data only, the library's
  current stream (the default one as 1 on CUDA, 0 on ROCm), retried without ``max_version`` on a
  ``TypeError``, with its ``copy`` passed on as PyTorch passes it;
- ``__dlpack__`` as PyTorch 2.13's ``Tensor.__dlpack__`` for a CUDA (ROCm) tensor: an omitted
  ``stream`` is -1 (no synchronization), a non-int one a ``TypeError``, CUDA's 2 a ``BufferError``
  and CUDA's 0 (ROCm's 1 and 2) an ``AssertionError``, and it orders the library's *current* stream,
  not the array's last writer, before the consumer's; or, with ``honours_stream=False``, as
  cuda.core's ``Buffer.__dlpack__`` (0.3 to 2026): ``stream`` is not read, nothing is ordered,
  ``dl_device`` and ``copy=True`` are refused with its ``BufferError``s;
- ``as_array`` as numba-cuda 0.30's ``cuda.as_cuda_array``: the CUDA Array Interface alone, its
  ``stream`` synchronized on the host first (numba's default ``sync=True``).

For the tests and the demo of ``handoff-trace run --order`` (examples/cross_library.py).

    torchlike = make_library("simtorch")
    careless = make_library("simnano", honours_stream=False)
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import handoff
from handoff import sim

ROCM = handoff.runtime_info()["backend"] == "sim-rocm"
# The DLPack stream value of the device's default stream: ROCm numbers it 0, CUDA 1.
DEFAULT_STREAM = 0 if ROCM else 1
CUDA, ROCM_DEVICE = 2, 10  # DLPack's device types of the data PyTorch passes its stream for


class _Capsule:
    """A capsule a consumer already has, handed to handoff as the array it imports."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule, self._device = capsule, device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def export_as_torch(
    data: handoff.Array, owner: Any, current: int, *, stream: Any = -1, max_version: Any = None,
    dl_device: Any = None, copy: Any = None,
) -> Any:  # fmt: skip
    """`data` (of `owner`, which the capsule keeps) exported as PyTorch 2.13's ``Tensor.__dlpack__``
    exports a CUDA (ROCm) tensor: an omitted `stream` is -1, no synchronization; a non-int one is a
    ``TypeError``; CUDA's 2 a ``BufferError`` and CUDA's 0 (ROCm's 1 and 2) an ``AssertionError``;
    any other value makes the consumer's stream wait for PyTorch's current stream, `current` (not the
    stream of the data's last write), unless they are the same stream."""
    if stream is not None and type(stream) is not int:
        raise TypeError("stream must be ``int`` or ``none``")
    if stream is not None and stream not in (-1, DEFAULT_STREAM):
        if not ROCM and stream == 2:
            raise BufferError("per-thread default stream is not supported.")
        if (not ROCM and stream == 0) or (ROCM and stream in (1, 2)):
            raise AssertionError(f"unsupported stream on {'ROCm' if ROCM else 'CUDA'}: {stream}.")
    ready = -1 if stream == -1 else current
    on_current = handoff.view(data.data_ptr, data.shape, data.dtype, device=data.device, owner=owner, stream=ready)
    return on_current.__dlpack__(
        stream=DEFAULT_STREAM if stream is None else stream, max_version=max_version, dl_device=dl_device, copy=copy
    )


class _Interface:
    """A CUDA Array Interface read from a producer, offered alone (DLPack is not asked)."""

    def __init__(self, interface: dict, owner: Any) -> None:
        self.__cuda_array_interface__ = interface
        self._owner = owner


def make_library(name: str, *, honours_stream: bool = True, register: bool = True) -> types.ModuleType:
    """A library named `name` (a module in sys.modules, so its arrays' type names it), registered with
    handoff's hooks through a LibraryAdapter unless `register` is False."""
    library = types.ModuleType(name, f"a simulated array library ({'honours' if honours_stream else 'ignores'} stream)")
    current: list[Any] = [None]  # the library's current stream (a sim.Stream); None: the default stream

    def stream_value() -> int | None:
        return None if current[0] is None else int(current[0].handle)

    def current_value() -> int:
        """The library's current stream as a DLPack value (the default stream's for none)."""
        value = stream_value()
        return DEFAULT_STREAM if value is None else value

    class Array(handoff.Exporter):
        """An array of the library: device data on the simulator. Its exports keep it alive, as a real
        library's capsule keeps its array."""

        def __init__(self, data: handoff.Array) -> None:
            self._data = data

        shape = property(lambda self: self._data.shape)
        dtype = property(lambda self: self._data.dtype)
        nbytes = property(lambda self: self._data.nbytes)

        def __handoff_array__(self) -> handoff.Array:
            return self._data

        def __dlpack__(self, *, stream: Any = -1, **kwargs: Any) -> Any:
            if not honours_stream:  # cuda.core's Buffer.__dlpack__: `stream` is ignored, as if -1
                if kwargs.get("dl_device") is not None:
                    raise BufferError("Sorry, not supported: dl_device other than None")
                if kwargs.get("copy") is True:
                    raise BufferError("Sorry, not supported: copy=True")
                return super().__dlpack__(stream=-1, max_version=kwargs.get("max_version"))
            return export_as_torch(self._data, self, current_value(), stream=stream, **kwargs)

    Array.__module__ = name
    Array.__qualname__ = "Array"

    @contextlib.contextmanager
    def use(stream: Any) -> Iterator[Any]:
        """Makes `stream` (a sim.Stream, or a native handle) the library's current stream."""
        if isinstance(stream, int):
            stream = handoff.Stream(stream)
        previous, current[0] = current[0], stream
        try:
            yield stream
        finally:
            current[0] = previous

    def zeros(n: int) -> Array:
        return Array(sim.zeros(n, "float32"))  # zeroed and ready: nothing is enqueued

    def fill(array: Array, value: float) -> None:
        """Enqueues a write of `value` on the current stream (held there by a `sim.hold` of it)."""
        sim.fill(array._data, value, stream=current[0] or handoff.Stream(DEFAULT_STREAM))

    def as_array(producer: Any) -> Array:
        """Imports `producer` as numba-cuda's ``cuda.as_cuda_array`` does: its CUDA Array Interface
        alone, whose `stream` the host synchronizes first; the producer is kept by the array."""
        interface = producer.__cuda_array_interface__
        if interface.get("stream") is not None:
            sim.to_numpy(sim.zeros(1), stream=handoff.Stream(interface["stream"]))  # waits for that stream
        return Array(handoff.asarray(_Interface(interface, producer), stream=-1))

    def from_dlpack(ext_tensor: Any, *, copy: bool | None = None) -> Array:
        """Imports `ext_tensor` as PyTorch's ``torch.from_dlpack`` does (see the module's docstring;
        the parameter's name is PyTorch's), and keeps the capsule (its producer) until the array goes,
        with no stream-ordered release of its own."""
        arguments: dict[str, Any] = {"max_version": (1, 0)}
        if copy is not None:
            arguments["copy"] = copy
        device = ext_tensor.__dlpack_device__()
        if device[0] in (CUDA, ROCM_DEVICE):
            arguments["stream"] = current_value()
        try:
            capsule = ext_tensor.__dlpack__(**arguments)
        except TypeError:
            del arguments["max_version"]
            capsule = ext_tensor.__dlpack__(**arguments)
        return Array(handoff.from_dlpack(_Capsule(capsule, device), stream=-1))

    def view(array: Array) -> Array:
        """A new array of the same data, as a PyTorch view shares its tensor's storage: the data stays
        while either is alive."""
        return Array(handoff.from_dlpack(array._data, stream=-1))

    def to_numpy(array: Array, *, wait: bool = True) -> Any:
        """Reads the array on the library's current stream (what a kernel there would see); with
        `wait` False, returns the read enqueued (a sim.PendingCopy), for a test that holds a stream."""
        return sim.to_numpy(array._data, stream=current[0] or handoff.Stream(DEFAULT_STREAM), wait=wait)

    library.Stream = lambda: sim.Stream(non_blocking=True)  # type: ignore[attr-defined]
    library.synchronize = sim.synchronize  # type: ignore[attr-defined]
    library.Array = Array  # type: ignore[attr-defined]
    library.use = use  # type: ignore[attr-defined]
    library.zeros = zeros  # type: ignore[attr-defined]
    library.fill = fill  # type: ignore[attr-defined]
    library.from_dlpack = from_dlpack  # type: ignore[attr-defined]
    library.view = view  # type: ignore[attr-defined]
    library.as_array = as_array  # type: ignore[attr-defined]
    library.to_numpy = to_numpy  # type: ignore[attr-defined]
    sys.modules[name] = library
    if register:
        handoff.register_library(
            handoff.LibraryAdapter(
                name,
                consumers=(f"{name}:from_dlpack", f"{name}:as_array"),
                interface_first=(f"{name}:as_array",),
                producers=(f"{name}:Array",),
                # The stream object (CuPy's adapter gives CuPy's), or the default stream's value.
                current_stream=lambda device: DEFAULT_STREAM if current[0] is None else current[0],
                use_stream=lambda handle, device: use(handle),
                ignores_stream=not honours_stream,
            )
        )
    return library
