"""Small array libraries on the simulated device that exchange as real peers do, without going
through handoff's hooks themselves: a current stream per library, thread and device, as PyTorch's
``torch.cuda.current_stream(device)`` is (a stream object, which the library's adapter gives handoff,
as CuPy's does: a stream object destroys its stream when it goes), and

- ``from_dlpack`` as PyTorch 2.13's ``torch.from_dlpack`` (``torch/utils/dlpack.py``): the producer's
  ``__dlpack_device__`` first, then its ``__dlpack__`` with ``max_version=(1, 0)``, its ``copy`` if
  given, ``dl_device`` if its ``device`` is the producer's device, and, for CUDA or ROCm data only,
  the current stream of the data's device (the default one as 1 on CUDA, 0 on ROCm); on a
  ``TypeError`` asked again without ``max_version``, then without ``copy`` (then ``copy=True`` is a
  clone of the import, on the current stream), then without ``dl_device`` (whose ``TypeError`` is
  raised); a ``device`` that is another device is a copy after the import (``copy=False``: its
  ``ValueError``), and a capsule given with ``device`` or ``copy`` its ``AssertionError``;
- ``__dlpack__`` as PyTorch 2.13's ``Tensor.__dlpack__`` for a CUDA (ROCm) tensor: an omitted
  ``stream`` is -1 (no synchronization), a non-int one a ``TypeError``, CUDA's 2 a ``BufferError``
  and CUDA's 0 (ROCm's 1 and 2) an ``AssertionError``, and it orders the library's *current* stream
  (of this thread, on the array's device, which PyTorch requires to be the current device), not the
  array's last writer, before the consumer's; or, with ``honours_stream=False``, as cuda.core's
  ``Buffer.__dlpack__`` (0.3 to 2026): ``stream`` is not read, nothing is ordered, ``dl_device`` and
  ``copy=True`` are refused with its ``BufferError``s;
- ``as_array`` as numba-cuda 0.30's ``cuda.as_cuda_array``: the CUDA Array Interface alone, its
  ``stream`` synchronized on the host first (numba's default ``sync=True``).

A move between two devices of the simulator (``from_dlpack(x, device="cuda:1")`` of data on device
0), which PyTorch makes with ``Tensor.to``, is not modelled: ``NotImplementedError``.

For the tests and the demo of ``handoff-trace run --order`` (examples/cross_library.py).

    torchlike = make_library("simtorch")
    careless = make_library("simnano", honours_stream=False)
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import handoff
from handoff import sim

ROCM = handoff.runtime_info()["backend"] == "sim-rocm"
# The DLPack stream value of the device's default stream: ROCm numbers it 0, CUDA 1.
DEFAULT_STREAM = 0 if ROCM else 1
CUDA, ROCM_DEVICE = 2, 10  # DLPack's device types of the data PyTorch passes its stream for
CPU = 1


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
    # The library's current streams (sim.Stream or handoff.Stream objects) by device, per thread, as
    # torch.cuda.current_stream(device)'s are; a device that has none is on its default stream.
    state = threading.local()

    def streams() -> dict[int, Any]:
        if not hasattr(state, "streams"):
            state.streams = {}
        return state.streams

    def current_stream(device: int = 0) -> Any:
        """This thread's current stream of `device` (a stream object), None for the default stream."""
        return streams().get(device)

    def current_value(device: int = 0) -> int:
        """This thread's current stream of `device` as a DLPack value (the default stream's for none)."""
        stream = current_stream(device)
        return DEFAULT_STREAM if stream is None else int(stream.handle)

    def on_current(device: int = 0) -> Any:
        """The stream a kernel of the library launches on now, on `device`."""
        return current_stream(device) or handoff.Stream(DEFAULT_STREAM, device=device)

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
            return export_as_torch(self._data, self, current_value(self._data.device[1]), stream=stream, **kwargs)

    Array.__module__ = name
    Array.__qualname__ = "Array"

    @contextlib.contextmanager
    def use(stream: Any, device: int | None = None) -> Iterator[Any]:
        """Makes `stream` (a sim.Stream, or a native handle) the library's current stream of its device
        (`device`, else the stream's own, else 0) on this thread, as ``torch.cuda.stream`` does."""
        if isinstance(stream, int):
            stream = handoff.Stream(stream, device=device)
        if device is None:
            device = handoff.as_stream(stream).device or 0
        current = streams()
        previous = current.get(device)
        current[device] = stream
        try:
            yield stream
        finally:
            current[device] = previous

    def zeros(n: int, device: int = 0) -> Array:
        return Array(sim.zeros(n, "float32", device=device))  # zeroed and ready: nothing is enqueued

    def fill(array: Array, value: float) -> None:
        """Enqueues a write of `value` on the current stream (held there by a `sim.hold` of it)."""
        sim.fill(array._data, value, stream=on_current(array._data.device[1]))

    def as_array(producer: Any) -> Array:
        """Imports `producer` as numba-cuda's ``cuda.as_cuda_array`` does: its CUDA Array Interface
        alone, whose `stream` the host synchronizes first; the producer is kept by the array."""
        interface = producer.__cuda_array_interface__
        if interface.get("stream") is not None:
            sim.to_numpy(sim.zeros(1), stream=handoff.Stream(interface["stream"]))  # waits for that stream
        return Array(handoff.asarray(_Interface(interface, producer), stream=-1))

    def dl_device_of(device: Any) -> tuple[int, int]:
        """torch._C._torchDeviceToDLDevice of a device spelled as a string ("cpu", "cuda:N"; PyTorch
        for ROCm spells its devices "cuda" too), or an object with `type` and `index`."""
        if isinstance(device, str):
            kind, _, index = device.partition(":")
            device = types.SimpleNamespace(type=kind, index=int(index) if index else None)
        if device.type == "cpu":
            return (CPU, 0)
        if device.type != "cuda" or device.index is None:
            raise NotImplementedError(f"the simulated library does not model the device {device!r}")
        return (ROCM_DEVICE if ROCM else CUDA, device.index)

    def from_dlpack(ext_tensor: Any, *, device: Any = None, copy: bool | None = None) -> Array:
        """Imports `ext_tensor` as PyTorch 2.13's ``torch.from_dlpack`` does (see the module's
        docstring; the parameters' names are PyTorch's), and keeps the capsule (its producer) until
        the array goes, with no stream-ordered release of its own."""
        if not hasattr(ext_tensor, "__dlpack__"):
            if device is not None or copy is not None:
                raise AssertionError(
                    "device and copy kwargs not supported when ext_tensor is already a DLPack capsule."
                )
            return Array(handoff.from_dlpack(ext_tensor, stream=-1))  # torch._C._from_dlpack: no ordering
        kwargs: dict[str, Any] = {"max_version": (1, 0)}
        requested_copy, producer_handled_copy, cross_device_transfer = copy, True, False
        if copy is not None:
            kwargs["copy"] = copy
        ext_device = ext_tensor.__dlpack_device__()
        if device is not None:
            if not isinstance(device, str) and not hasattr(device, "type"):
                raise AssertionError(f"from_dlpack: unsupported device type: {type(device)}")
            target_dl_device = dl_device_of(device)
            cross_device_transfer = ext_device != target_dl_device
            if not cross_device_transfer:
                kwargs["dl_device"] = target_dl_device
            if cross_device_transfer and copy is False:
                raise ValueError(
                    f"cannot move DLPack tensor from device {ext_device} to {target_dl_device} "
                    "without copying. Set copy=None or copy=True."
                )
        if ext_device[0] in (CUDA, ROCM_DEVICE):
            kwargs["stream"] = current_value(ext_device[1])
        capsule = None
        with contextlib.suppress(TypeError):  # the retries of torch/utils/dlpack.py, in its order
            capsule = ext_tensor.__dlpack__(**kwargs)
        if capsule is None:
            kwargs.pop("max_version", None)
            with contextlib.suppress(TypeError):
                capsule = ext_tensor.__dlpack__(**kwargs)
        if capsule is None:
            kwargs.pop("copy", None)
            producer_handled_copy = False
            with contextlib.suppress(TypeError):
                capsule = ext_tensor.__dlpack__(**kwargs)
        if capsule is None:
            kwargs.pop("dl_device", None)
            capsule = ext_tensor.__dlpack__(**kwargs)
        data = handoff.from_dlpack(_Capsule(capsule, ext_device), stream=-1)
        if requested_copy is True and not producer_handled_copy and not cross_device_transfer:
            data = clone(data)  # Tensor.clone, on the current stream
        if cross_device_transfer:
            assert device is not None
            data = moved(data, dl_device_of(device))
        return Array(data)

    def clone(data: handoff.Array) -> handoff.Array:
        if data.device[0] in (CUDA, ROCM_DEVICE):
            return handoff.from_dlpack(data, copy=True, stream=on_current(data.device[1]))
        return handoff.from_dlpack(data, copy=True)

    def moved(data: handoff.Array, device: tuple[int, int]) -> handoff.Array:
        """Tensor.to(device): the host's copy of device data; a move between devices is not modelled."""
        if device[0] != CPU:
            raise NotImplementedError("the simulated library does not model a move between devices")
        return handoff.from_dlpack(data, device=device, copy=True)

    def view(array: Array) -> Array:
        """A new array of the same data, as a PyTorch view shares its tensor's storage: the data stays
        while either is alive."""
        return Array(handoff.from_dlpack(array._data, stream=-1))

    def to_numpy(array: Array, *, wait: bool = True) -> Any:
        """Reads the array on the library's current stream (what a kernel there would see); with
        `wait` False, returns the read enqueued (a sim.PendingCopy), for a test that holds a stream."""
        return sim.to_numpy(array._data, stream=on_current(array._data.device[1]), wait=wait)

    library.Stream = lambda: sim.Stream(non_blocking=True)  # type: ignore[attr-defined]
    library.synchronize = sim.synchronize  # type: ignore[attr-defined]
    library.Array = Array  # type: ignore[attr-defined]
    library.use = use  # type: ignore[attr-defined]
    library.current_stream = current_stream  # type: ignore[attr-defined]
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
                current_stream=lambda device: current_stream(device or 0) or DEFAULT_STREAM,
                use_stream=use,
                ignores_stream=not honours_stream,
            )
        )
    return library
