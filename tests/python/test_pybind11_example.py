"""The pybind11 helper (<handoff/pybind11.hpp>) through examples/pybind11, an extension built against
the installed package with find_package(handoff): a C++ tensor type that exports itself, and
functions that take handoff::py::array<...> arguments.

The test command builds it into build/example-pybind11 (HANDOFF_PYBIND11_EXAMPLE names another
folder); the tests skip, saying so, where it was not built.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import handoff

from support import SIM, needs_sim, pending_write

if SIM:
    from handoff import sim

_folder = Path(os.environ.get("HANDOFF_PYBIND11_EXAMPLE", Path(__file__).parents[2] / "build" / "example-pybind11"))
if not any(_folder.glob("tensor_example*.so")):
    pytest.skip(f"examples/pybind11 is not built in {_folder} (the test command builds it)", allow_module_level=True)
sys.path.insert(0, str(_folder))
import tensor_example as te  # noqa: E402


def test_the_tensor_exports_itself_to_every_consumer(torch, settled):
    t = te.Tensor(2, 3, 1.5)
    assert np.from_dlpack(t).tolist() == [[1.5] * 3] * 2
    assert torch.from_dlpack(t).sum().item() == 9.0
    assert handoff.from_dlpack(t).shape == (2, 3)
    assert t.__dlpack_device__() == (1, 0)
    assert not hasattr(t, "__cuda_array_interface__"), "host memory has no CUDA Array Interface"


def test_exported_data_keeps_the_tensor_alive(settled):
    t = te.Tensor(1, 4, 2.0)
    watch = weakref.ref(t)
    imported = np.from_dlpack(t)
    del t
    gc.collect()
    assert watch() is not None
    assert imported.tolist() == [[2.0] * 4]
    del imported
    gc.collect()
    assert watch() is None


def test_array_arguments_take_any_protocol_zero_copy(torch):
    assert te.sum(np.arange(6, dtype=np.float32).reshape(2, 3)) == 15.0
    assert te.sum(torch.ones(4)) == 4.0
    assert te.sum(te.Tensor(2, 2, 0.5)) == 2.0
    values = np.ones(6, np.float32)
    te.scale(values[::2], 3.0)  # strided, written in place
    assert values.tolist() == [3, 1, 3, 1, 3, 1]
    rows = np.zeros((4, 3), np.float32)
    returned = te.rows_of_three(rows)
    assert isinstance(returned, handoff.Array)
    assert returned.data_ptr == rows.ctypes.data


def test_read_only_data_needs_ro():
    values = np.ones(3, np.float32)
    values.flags.writeable = False
    assert te.sum(values) == 3.0
    with pytest.raises(TypeError, match="incompatible function arguments"):
        te.scale(values, 2.0)


@pytest.mark.parametrize(
    ("call", "argument", "signature"),
    [
        (te.sum, np.zeros(3), r"values: handoff.Array\[float32, device='cpu', order='C', readonly\]"),
        (te.sum, np.zeros((3, 3), np.float32).T, r"order='C'"),
        (te.rows_of_three, np.zeros((4, 2), np.float32), r"handoff.Array\[float32, shape=\(\*, 3\)\]"),
        (te.scale, np.zeros((2, 2), np.float32), r"handoff.Array\[float32, ndim=1, device='cpu'\]"),
        (te.sum, "not an array", r"handoff.Array\[float32"),
    ],
    ids=["dtype", "order", "shape", "ndim", "no protocol"],
)
def test_a_mismatch_lists_the_accepted_signature(call, argument, signature):
    with pytest.raises(TypeError, match=signature):
        call(argument) if call is not te.scale else call(argument, 2.0)


@needs_sim
def test_a_device_argument_is_ordered_onto_the_consumer_stream(sim_streams):
    producer, consumer = sim_streams
    pending = pending_write(producer, 3 * 1024)
    with handoff.stream(consumer):
        imported = te.rows_of_three(
            handoff.view(pending.data_ptr, (1024, 3), "float32", device=pending.device, owner=pending, stream=producer)
        )
    assert sim.to_numpy(imported, stream=consumer)[[0, -1]].tolist() == [[1.0] * 3] * 2


@needs_sim
def test_negative_control_the_consumer_stream_races_without_the_import(sim_streams):
    producer, consumer = sim_streams
    pending = pending_write(producer, 3 * 1024)
    assert sim.to_numpy(pending, stream=consumer)[0] == 0.0, "expected stale data without ordering"


class RaisingProducer:
    """A producer whose __dlpack__ raises: its error is no "does not fit"."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __dlpack__(self, **kwargs):
        raise self.error

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize(
    "error",
    [
        KeyboardInterrupt(),
        SystemExit(3),
        MemoryError(),
        handoff.DeviceError("device failed"),
        ValueError("mine"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_argument_whose_import_fails_raises_that_error(error):
    # Only "this object does not fit" lets pybind11 try the next overload.
    with pytest.raises(type(error)) as raised:
        te.sum(RaisingProducer(error))
    assert raised.value is error


def test_an_object_with_no_array_protocol_does_not_fit():
    with pytest.raises(TypeError, match="incompatible function arguments"):
        te.sum(object())
