"""Small array libraries on the simulated device that exchange as PyTorch's and CuPy's CUDA paths do,
without going through handoff's hooks themselves: a current stream per library, a ``from_dlpack`` that
passes it to the producer, and a ``__dlpack__`` that honours the ``stream`` argument or, like
cuda.core's or nanobind's, ignores it. For the tests and the demo of ``handoff-trace run --order``
(examples/cross_library.py).

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

# The DLPack stream value of the device's default stream: ROCm numbers it 0, CUDA 1.
DEFAULT_STREAM = 0 if handoff.runtime_info()["backend"] == "sim-rocm" else 1


class _Capsule:
    """A capsule a consumer already has, handed to handoff as the array it imports."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule, self._device = capsule, device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def make_library(name: str, *, honours_stream: bool = True, register: bool = True) -> types.ModuleType:
    """A library named `name` (a module in sys.modules, so its arrays' type names it), registered with
    handoff's hooks through a LibraryAdapter unless `register` is False."""
    library = types.ModuleType(name, f"a simulated array library ({'honours' if honours_stream else 'ignores'} stream)")
    current: list[Any] = [None]  # the library's current stream (a sim.Stream); None: the default stream

    def stream_value() -> int | None:
        return None if current[0] is None else int(current[0].handle)

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

        def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
            # Ignoring `stream`, the export orders only for the default stream, which a non-blocking
            # consumer stream does not wait for.
            return super().__dlpack__(stream=stream if honours_stream else None, **kwargs)

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

    def fill(array: Array, value: float, delay: float = 0.0) -> None:
        """Enqueues a write of `value` on the current stream, taking `delay` seconds."""
        sim.fill(array._data, value, stream=current[0] or handoff.Stream(DEFAULT_STREAM), delay=delay)

    def as_array(producer: Any) -> Array:
        """Imports `producer` as Numba does: through its CUDA Array Interface first."""
        return Array(handoff.asarray(producer))

    def from_dlpack(producer: Any) -> Array:
        """Imports `producer` as PyTorch does: asks its ``__dlpack__`` for the data, passing the
        library's current stream, and keeps the capsule (its producer) until the array goes, with no
        stream-ordered release of its own."""
        value = stream_value()
        capsule = producer.__dlpack__(stream=DEFAULT_STREAM if value is None else value, max_version=(1, 0))
        return Array(handoff.from_dlpack(_Capsule(capsule, producer.__dlpack_device__()), stream=-1))

    def to_numpy(array: Array, wait: bool = True) -> Any:
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
                current_stream=lambda device: stream_value(),
                use_stream=lambda handle, device: use(handle),
                ignores_stream=not honours_stream,
            )
        )
    return library
