"""Typed uses of handoff, for mypy (test_typing.py checks this file; it is never run).

Each `assert_type` states what the stubs give a caller; each `# type: ignore[code]` marks a call the
stubs must reject, which mypy's --warn-unused-ignores turns into a failure when they accept it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import CapsuleType, assert_type

import handoff
import handoff.sim as sim


class Producer:
    """A producer whose __dlpack__ declares none of DLPack's optional arguments, as JAX 0.10's stubs
    do (jax/_src/basearray.pyi)."""

    def __dlpack__(self) -> object:
        raise NotImplementedError


def imports(host: npt.NDArray[np.float32], capsule: CapsuleType) -> None:
    a = handoff.from_dlpack(host)
    assert_type(a, handoff.Array)
    assert_type(handoff.from_dlpack(Producer()), handoff.Array)
    assert_type(handoff.from_dlpack(capsule), handoff.Array)
    assert_type(handoff.from_dlpack(a, device="cpu", copy=True, stream=None), handoff.Array)
    assert_type(handoff.asarray(host), handoff.Array)
    assert_type(handoff.asarray(b"bytes"), handoff.Array)  # the buffer protocol
    assert_type(handoff.asarray(memoryview(bytearray(8)), device=(1, 0), copy=False), handoff.Array)

    handoff.from_dlpack(b"bytes")  # type: ignore[arg-type]  # no __dlpack__
    handoff.asarray(42)  # type: ignore[arg-type]  # no array protocol
    handoff.from_dlpack(host, copy="yes")  # type: ignore[arg-type]
    handoff.from_dlpack(host, device="cuda")  # type: ignore[arg-type]  # 'cpu' or a DLPack device
    handoff.from_dlpack(host, None)  # type: ignore[call-arg]  # device, copy and stream are keywords


def array_attributes(a: handoff.Array) -> None:
    assert_type(a.shape, tuple[int, ...])
    assert_type(a.strides, tuple[int, ...])
    assert_type(a.dtype, str)
    assert_type(a.device, tuple[int, int])
    assert_type(a.data_ptr, int)
    assert_type(a.readonly, bool)
    assert_type(a.ndim + a.size + a.nbytes, int)
    assert_type(a.__array_interface__, dict[str, Any])
    assert_type(a.__cuda_array_interface__, dict[str, Any])
    assert_type(a.__dlpack__(stream=1, max_version=(1, 1), dl_device=(1, 0), copy=None), CapsuleType)
    assert_type(a.__dlpack_device__(), tuple[int, int])
    assert_type(handoff.Array.__dlpack_c_exchange_api__, CapsuleType)

    a.shape = (1,)  # type: ignore[misc]  # read-only
    a.__dlpack__(stream=handoff.Stream(0))  # type: ignore[arg-type]  # a DLPack stream value is an int


def other_libraries(a: handoff.Array) -> None:
    # handoff.Array is an array to NumPy's from_dlpack.
    np.from_dlpack(a)  # accepted as NumPy's DLPack producer protocol


def streams() -> None:
    s = handoff.Stream(0x1234, device=0)
    assert_type(s.handle, int)
    assert_type(s.device, int | None)
    assert_type(handoff.as_stream(s), handoff.Stream)
    assert_type(handoff.current_stream(), handoff.Stream | None)
    with handoff.stream(s) as entered:
        assert_type(entered, handoff.Stream | None)
    with handoff.stream(None):
        pass

    on_sim = sim.Stream(0, non_blocking=True)
    x = sim.zeros((2, 3), "float32", memory="pinned")
    assert_type(x, handoff.Array)
    sim.fill(x, 1.5, stream=on_sim, delay=0.01)
    sim.fill(x, 2, stream=s)
    handoff.from_dlpack(x, stream=on_sim)  # a stream object: __cuda_stream__
    handoff.from_dlpack(x, stream=-1)
    assert_type(sim.to_numpy(x, stream=on_sim), npt.NDArray[Any])
    sim.begin_capture(on_sim)
    graph = sim.end_capture(on_sim)
    assert_type(graph, sim.Graph)
    assert_type(len(graph), int)
    graph.launch(on_sim)
    assert_type(sim.violations(), list[str])
    assert_type(sim.live_allocations(), int)

    sim.zeros(4, memory="host")  # type: ignore[arg-type]  # 'device', 'pinned' or 'managed'
    handoff.from_dlpack(x, stream="default")  # type: ignore[arg-type]  # not a stream


def library_authors(data_ptr: int) -> None:
    class Buffer(handoff.Exporter):
        def __handoff_array__(self) -> handoff.Array:
            return handoff.view(data_ptr, (4,), "float32", device="cpu", owner=self)

    b = Buffer()
    assert_type(b.__dlpack__(max_version=(1, 0)), CapsuleType)
    assert_type(b.__dlpack_device__(), tuple[int, int])
    assert_type(handoff.from_dlpack(b), handoff.Array)
    assert_type(handoff.view(data_ptr, 4, np.dtype(np.int8), device=(2, 0), stream=7), handoff.Array)
    handoff.view(data_ptr, (4,), "float32")  # type: ignore[call-arg]  # device is required


def runtime() -> None:
    info = handoff.runtime_info()
    assert_type(info["device_count"], int)
    assert_type(info["cuda_runtime"], str | None)
    assert_type(info["backend_error"], str | None)
    if info["backend"] == "sim":
        pass
    counters = handoff.stats()
    assert_type(counters["waits_inserted"] + counters["live_views"], int)
    assert_type(handoff.reset_stats(), None)
    assert_type(handoff.__version__, str)

    info["nope"]  # type: ignore[typeddict-item]
    counters["waits"]  # type: ignore[typeddict-item]

    try:
        sim.synchronize()
    except handoff.DeviceError as e:
        assert_type(e.error_name, str)
        assert_type(e.backend, str)
