"""The pybind11 helper (<handoff/pybind11.hpp>) through examples/pybind11, an extension built against
the installed package with find_package(handoff): a C++ tensor type that exports itself, and
functions that take handoff::pybind::array<...> arguments.

The test command builds it into build/example-pybind11 (HANDOFF_PYBIND11_EXAMPLE names another
folder); the tests skip, saying so, where it was not built.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import handoff

from dlpack_ctypes import CUDA, CUDA_HOST, DLManagedTensorVersioned, HandMadeTensor, exchange_api_of
from support import CUDA_ORDERING_REFUSED, SIM, needs_sim, pending_write, run_python, waiting_read

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


def pass_pending_rows(function, producer, consumer):
    """`function` called inside a handoff.stream(consumer) block with 1024 rows of three float32s
    whose write of 1.0 is enqueued on `producer`: still pending while the caller holds `producer`."""
    pending = pending_write(producer, 3 * 1024)
    with handoff.stream(consumer):
        return function(
            handoff.view(pending.data_ptr, (1024, 3), "float32", device=pending.device, owner=pending, stream=producer)
        )


@needs_sim
def test_a_device_argument_is_ordered_onto_the_consumer_stream(sim_streams):
    producer, consumer = sim_streams
    with sim.hold(producer):
        imported = pass_pending_rows(te.rows_of_three, producer, consumer)
        read = waiting_read(imported, consumer)
    assert read.result()[[0, -1]].tolist() == [[1.0] * 3] * 2


@needs_sim
def test_a_parameter_that_orders_itself_gets_no_wait(sim_streams):
    # hp::orders_itself: the function promised to order its own work (stream=-1); handoff inserts
    # nothing, so a read on the consumer stream at once races the producer, as it must here.
    producer, consumer = sim_streams
    with sim.hold(producer):
        imported = pass_pending_rows(te.rows_of_three_unordered, producer, consumer)
        assert sim.to_numpy(imported, stream=consumer)[0].tolist() == [0.0] * 3, "expected stale data: nothing waited"


class CudaClaimingProducer:
    """Host memory that says it is CUDA memory of device 0, for a backend that has no CUDA."""

    def __init__(self) -> None:
        self.values = np.zeros((2, 3), np.float32)
        self.tensor = HandMadeTensor(self.values.ctypes.data, (2, 3), device=(CUDA, 0))

    def __dlpack__(self, **kwargs):
        return self.tensor.capsule()

    def __dlpack_device__(self):
        return (CUDA, 0)


@pytest.mark.skipif(not CUDA_ORDERING_REFUSED, reason="needs HANDOFF_BACKEND=auto where CUDA cannot start")
def test_cuda_data_where_cuda_cannot_start_is_taken_only_by_a_parameter_that_orders_itself():
    refused = CudaClaimingProducer()
    with pytest.raises(handoff.DeviceError):
        te.rows_of_three(refused)
    assert refused.tensor.deleted == 1, "the refused tensor was let go, once"
    producer = CudaClaimingProducer()  # its tensor must outlive the import
    imported = te.rows_of_three_unordered(producer)
    assert imported.device == (CUDA, 0)
    del imported
    gc.collect()
    assert producer.tensor.deleted == 1


@needs_sim
def test_negative_control_the_consumer_stream_races_without_the_import(sim_streams):
    producer, consumer = sim_streams
    with sim.hold(producer):
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


# --- nb::ndarray's accessors, view(), float16/bfloat16, mismatch reasons, __array_interface__ ----


@pytest.fixture
def jax():
    """JAX on its CPU device, or a skip where it is not installed."""
    jax = pytest.importorskip("jax")
    with jax.default_device(jax.devices("cpu")[0]):
        yield jax


def test_the_accessors_describe_any_array(torch, jax):
    assert te.describe(np.zeros((2, 3))) == {
        "shape": (2, 3),
        "size": 6,
        "itemsize": 8,
        "nbytes": 48,
        "dtype": (2, 64, 1),  # kDLFloat, 64 bits, 1 lane
        "readonly": False,
        "device": (1, 0),
    }
    described = te.describe(torch.zeros(5, dtype=torch.bfloat16))
    assert (described["dtype"], described["itemsize"], described["nbytes"]) == ((4, 16, 1), 2, 10)  # kDLBfloat
    frozen = np.zeros(4, np.int16)
    frozen.flags.writeable = False
    assert te.describe(frozen)["readonly"] is True
    assert te.describe(jax.numpy.ones((3, 4), jax.numpy.float32))["nbytes"] == 48


def test_view_indexes_through_the_strides(torch, jax):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert te.sum_2d(values) == 66.0
    assert te.sum_2d(values[::2, ::3]) == 0 + 3 + 8 + 11
    assert te.sum_2d(values.T) == 66.0  # F order
    assert te.sum_2d(torch.arange(6, dtype=torch.float32).reshape(2, 3).t()) == 15.0
    assert te.sum_2d(jax.numpy.ones((2, 5), jax.numpy.float32)) == 10.0


def test_float16_round_trips_with_numpy():
    values = np.array([0.5, -1.0, 2.0, 65504.0], np.float16)
    returned = te.negate(values)  # the float16 overload
    assert isinstance(returned, handoff.Array)
    assert (returned.dtype, returned.data_ptr) == ("float16", values.ctypes.data)
    assert values.tolist() == [-0.5, 1.0, -2.0, -65504.0]
    back = np.asarray(returned)
    assert back.dtype == np.float16 and back.ctypes.data == values.ctypes.data
    assert np.from_dlpack(returned).tolist() == values.tolist()


def test_bfloat16_round_trips_with_torch(torch):
    values = torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16)
    returned = te.negate(values)  # the bfloat16 overload
    assert returned.dtype == "bfloat16"
    assert values.tolist() == [-1.5, 2.0, -3.0]
    back = torch.from_dlpack(returned)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == values.data_ptr()
    assert back.tolist() == values.tolist()


def test_the_signature_names_float16_and_bfloat16():
    assert "handoff.Array[float16, ndim=1, device='cpu']" in te.negate.__doc__
    assert "handoff.Array[bfloat16, ndim=1, device='cpu']" in te.negate.__doc__


def _read_only(values):
    values.flags.writeable = False
    return values


@pytest.mark.parametrize(
    ("call", "argument", "reason"),
    [
        (te.sum, np.zeros(3), r"\]: dtype is float64"),
        (te.sum, np.zeros(3, np.int32), r"\]: dtype is int32"),
        (te.scale, np.zeros((2, 2), np.float32), r"ndim=1, device='cpu'\]: ndim is 2"),
        (te.rows_of_three, np.zeros((4, 2), np.float32), r"shape=\(\*, 3\)\]: shape is \(4, 2\)"),
        (te.sum, np.zeros((3, 2), np.float32).T, r"readonly\]: order is not C \(strides \(1, 2\) in elements\)"),
        (te.scale, _read_only(np.zeros(3, np.float32)), r"device='cpu'\]: read-only \(the parameter is not ro\)"),
        (te.sum, "not an array", r"readonly\]: str speaks no array protocol"),
        (te.scale, np.zeros((2, 2), np.float64), r"\]: dtype is float64; ndim is 2"),
    ],
    ids=["dtype", "int dtype", "ndim", "shape", "order", "read-only", "no protocol", "two constraints"],
)
def test_a_mismatch_says_which_constraint_failed(call, argument, reason):
    with pytest.raises(TypeError, match="incompatible function arguments") as raised:
        call(argument) if call is not te.scale else call(argument, 2.0)
    message = str(raised.value)
    assert "Why the array arguments did not fit:" in message
    assert raised.match(reason)


def test_a_mismatch_names_each_overloads_reason(torch):
    with pytest.raises(TypeError) as raised:
        te.negate(torch.zeros((2, 2), dtype=torch.float16))
    assert raised.match(r"handoff.Array\[float16, ndim=1, device='cpu'\]: ndim is 2")
    assert raised.match(r"handoff.Array\[bfloat16, ndim=1, device='cpu'\]: dtype is float16; ndim is 2")


def test_an_explained_function_keeps_its_docstring_and_its_errors():
    assert te.sum.__doc__.startswith("sum(values: handoff.Array[float32, device='cpu', order='C', readonly]) -> float")
    with pytest.raises(ValueError, match="mine"):
        te.sum(RaisingProducer(ValueError("mine")))
    assert te.sum(np.ones(2, np.float32)) == 2.0  # a call after a mismatch carries no stale reason
    with pytest.raises(TypeError) as raised:
        te.sum(np.zeros(2, np.int8))
    assert "float64" not in str(raised.value) and raised.match("dtype is int8")


@needs_sim
def test_a_device_mismatch_names_the_device():
    with pytest.raises(TypeError) as raised:
        te.sum(sim.zeros((3,)))
    device = "rocm:0" if handoff.runtime_info()["backend"] == "sim-rocm" else "cuda:0"
    assert raised.match(rf"device='cpu', order='C', readonly\]: device is {device}")


def test_np_asarray_of_a_host_tensor_is_zero_copy_and_keeps_it_alive(settled):
    t = te.Tensor(2, 3, 1.5)
    interface = t.__array_interface__
    assert interface["shape"] == (2, 3) and interface["typestr"] == "<f4"
    assert interface["strides"] is None and interface["version"] == 3 and interface["data"][1] is False
    values = np.asarray(t)
    assert values.dtype == np.float32 and values.shape == (2, 3)
    assert values.ctypes.data == interface["data"][0], "np.asarray copied"
    values[1, 2] = 7.0
    assert np.from_dlpack(t)[1, 2] == 7.0
    watch = weakref.ref(t)
    del t
    gc.collect()
    assert watch() is not None, "the NumPy array must keep the tensor alive"
    assert values.sum() == 1.5 * 5 + 7.0
    del values
    gc.collect()
    assert watch() is None


def test_a_held_host_array_has_an_array_interface_with_its_strides():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    held = te.Held(values)
    interface = held.__array_interface__
    assert interface["strides"] == values.strides and interface["data"][0] == values.ctypes.data
    assert np.asarray(held).tolist() == values.tolist()
    assert not hasattr(held, "__cuda_array_interface__")


@needs_sim
def test_device_memory_has_no_array_interface():
    held = te.Held(sim.zeros((4,)))
    assert not hasattr(held, "__array_interface__"), "device memory has no __array_interface__"
    with pytest.raises(AttributeError, match="CPU"):
        held.__array_interface__  # noqa: B018
    if handoff.runtime_info()["backend"] == "sim":
        assert held.__cuda_array_interface__["shape"] == (4,)
    assert handoff.from_dlpack(held).shape == (4,)


@needs_sim
def test_torch_from_dlpack_of_a_def_dlpack_object_over_pinned_memory_says_how_to_import_it(torch):
    # PyTorch 2.13 imports no pinned host memory and never asks for it on the CPU (see
    # test_memory_kinds_sim.py): a def_dlpack class's __dlpack__ says what to do, as handoff.Array's does.
    source = sim.zeros((4,), memory="pinned")
    sim.synchronize()
    held = te.Held(source)
    assert held.__dlpack_device__() == source.device, "pinned memory is reported as DLPack says"
    with pytest.raises(BufferError, match=r"torch\.from_dlpack\(handoff\.from_dlpack\(x, device='cpu'\)\)"):
        torch.from_dlpack(held)
    assert torch.from_dlpack(handoff.from_dlpack(held, device="cpu")).data_ptr() == source.data_ptr


# ------------------------------------------------------------------------------------------------
# Arrays made in C++, returned as handoff.Array or as a framework's array


@pytest.mark.parametrize(
    ("make", "kind"),
    [("arange", "handoff"), ("arange_numpy", "numpy"), ("arange_torch", "torch"), ("arange_jax", "jax")],
)
def test_an_array_of_cpp_memory_reaches_python_as_asked_and_keeps_its_owner(make, kind, torch):
    if kind == "jax":
        pytest.importorskip("jax")
    freed = te.buffers_freed()
    made = getattr(te, make)(5)
    expected_type = {
        "handoff": handoff.Array,
        "numpy": np.ndarray,
        "torch": torch.Tensor,
    }.get(kind)
    if expected_type is not None:
        assert isinstance(made, expected_type)
    else:
        import jax

        assert isinstance(made, jax.Array)
    assert np.asarray(np.from_dlpack(made) if kind != "jax" else made).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    gc.collect()
    if kind != "jax":  # JAX may copy host memory it finds misaligned for XLA, and let the owner go
        assert te.buffers_freed() == freed, "the owner was let go while the array lives"
    del made
    gc.collect()
    assert te.buffers_freed() == freed + 1, "the owner outlived every array of its memory"


def test_an_array_of_cpp_memory_is_zero_copy():
    first = te.arange_numpy(3)
    again = np.from_dlpack(handoff.from_dlpack(first))
    assert again.ctypes.data == first.ctypes.data


def test_strides_and_read_only_reach_python():
    made = te.column_major()
    assert made.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert made.strides == (4, 8), "column-major: strides in elements times the item size"
    assert not made.flags.writeable


def test_an_array_of_cpp_memory_with_strides_that_do_not_fit_is_a_value_error():
    assert te.with_strides(1).shape == (1,)
    with pytest.raises(ValueError, match="2 strides for 1 dimensions"):
        te.with_strides(2)


@pytest.mark.parametrize(
    ("device", "why"),
    [((99, 0), "DLPack defines no such device type"), ((1, -5), "its id is negative"), ((2, -5), "its id is negative")],
)
def test_cpp_memory_on_a_device_dlpack_does_not_define_is_a_value_error(device, why):
    # The C++ constructor took it, and def_dlpack exported a capsule of device type 99.
    raw = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=why):
        te.device_result(raw.ctypes.data, 4, device, None, raw)


@pytest.mark.parametrize(
    ("data_ptr", "n", "why"),
    [(0, 4, "data is a null pointer but the array has elements"), (4096, -3, "negative")],
    ids=["null data", "negative extent"],
)
@pytest.mark.parametrize("trace", [False, True], ids=["untraced", "traced"])
def test_cpp_host_memory_with_a_bad_layout_is_a_value_error(data_ptr, n, why, trace):
    # Untraced, host memory with no stream takes the helper's fast path, which checks it itself.
    with handoff.trace() if trace else contextlib.nullcontext(), pytest.raises(ValueError, match=why):
        te.device_result(data_ptr, n, (1, 0))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (
            lambda raw: handoff.view(raw.ctypes.data, (8,), "bfloat16", device=(1, 0), owner=raw),
            "no dtype for bfloat16",
        ),
        (
            lambda raw: handoff.view(raw.ctypes.data, (1,) * 80, "float32", device=(1, 0), owner=raw),
            "at most 64 dimensions, and the array has 80",
        ),
    ],
    ids=["bfloat16", "80 dimensions"],
)
def test_the_numpy_tag_of_data_numpy_cannot_hold_is_a_buffer_error_naming_why(make, why, settled):
    # It passed NumPy's bare RuntimeError ("Unsupported dtype in DLTensor.") through.
    values = make(np.zeros(8, np.uint16))
    with pytest.raises(BufferError, match=why):
        te.as_numpy(values)


# ------------------------------------------------------------------------------------------------
# Device results of C++ code: the stream they are ready on, and the framework that takes them


@needs_sim
@pytest.mark.parametrize("how", ["argument", "block"])
def test_a_device_result_written_on_a_side_stream_orders_its_consumers_after_it(how, sim_streams):
    # hp::array(data, shape, owner, ...) always described stream 0: a result written by a kernel on
    # a non-blocking stream reached its consumers unordered.
    side, consumer = sim_streams
    memory = sim.zeros((4096,), "float32")
    sim.synchronize()
    with sim.hold(side):
        sim.fill(memory, 1.0, stream=side)  # the kernel that wrote the result, still queued
        if how == "argument":
            result = te.device_result(memory.data_ptr, 4096, memory.device, side.handle, owner=memory)
        else:
            with handoff.stream(side):  # the default: the enclosing block's stream
                result = te.device_result(memory.data_ptr, 4096, memory.device, owner=memory)
        imported = handoff.from_dlpack(result, stream=consumer)
    assert sim.to_numpy(imported, stream=consumer)[[0, -1]].tolist() == [1.0, 1.0]


@needs_sim
def test_negative_control_a_device_result_of_an_unknown_stream_races_with_its_side_stream(sim_streams):
    side, consumer = sim_streams
    memory = sim.zeros((4096,), "float32")
    sim.synchronize()
    with sim.hold(side):
        sim.fill(memory, 1.0, stream=side)
        result = te.device_result(memory.data_ptr, 4096, memory.device, 0, owner=memory)  # 0: unknown
        imported = handoff.from_dlpack(result, stream=consumer)
        seen = sim.to_numpy(imported, stream=consumer)  # ordered after the legacy stream only
    assert seen[0] == 0.0, "expected stale data: the side stream's write was not waited for"


# A framework as its source behaves, on the simulator, in a child process (it stands in for the real
# module there): from_dlpack hands __dlpack__ the framework's current stream, and the array it makes
# holds the DLPack tensor until it is collected.
FRAMEWORK_CHILD = """
import gc, sys, types, weakref
import handoff
from handoff import sim
sys.path.insert(0, {folder!r})
import tensor_example as te

current = sim.Stream(non_blocking=True)  # the framework's current stream


class Imported:  # the framework's array: it holds the DLPack tensor until it is collected
    def __init__(self, capsule):
        self.memory = handoff.from_dlpack(capsule, stream=-1)


class CupyStream:  # cupy.cuda.Stream of CuPy 14 (cupy/cuda/stream.pyx): ptr, the stream going with it
    def __init__(self, stream):
        self.stream = stream
        self.ptr = stream.handle


def cupy_get_current_stream(device_id=-1):
    return CupyStream(current)


def cupy_from_dlpack(array, *, device=None, copy=None):
    # cupy.from_dlpack of CuPy 14 (cupy/_core/dlpack.pyx): __dlpack__ gets the current stream's ptr
    array.__dlpack_device__()
    return Imported(array.__dlpack__(stream=cupy_get_current_stream().ptr, max_version=(1, 1), copy=copy))


class TorchStream:
    def __init__(self, stream):
        self.cuda_stream = stream.handle


def torch_from_dlpack(ext_tensor):
    # torch.from_dlpack of PyTorch 2.13 (torch/utils/dlpack.py): __dlpack__ gets the current stream
    # of the data's device (1 for the legacy stream, whose cuda_stream is 0)
    device = ext_tensor.__dlpack_device__()
    stream = TorchStream(current)
    stream_ptr = 1 if stream.cuda_stream == 0 else stream.cuda_stream
    return Imported(ext_tensor.__dlpack__(stream=stream_ptr, max_version=(1, 0)))


cupy = types.ModuleType("cupy")
cupy.from_dlpack = cupy_from_dlpack
cupy.cuda = types.ModuleType("cupy.cuda")
cupy.cuda.get_current_stream = cupy_get_current_stream
torch = types.ModuleType("torch")
torch.from_dlpack = torch_from_dlpack
sys.modules.update({{"cupy": cupy, "cupy.cuda": cupy.cuda, "torch": torch}})


class Owner:  # what frees the C++ result's memory
    def __init__(self, memory):
        self.memory = memory


memory = sim.zeros((4096,), "float32")
sim.synchronize()
owner = Owner(memory)
alive = weakref.ref(owner)
result = {make}(memory.data_ptr, 4096, memory.device, owner=owner)
del owner
with sim.hold(current):
    sim.fill(memory, 2.0, stream=current)  # the framework's work on the result, still queued
    del result
    gc.collect()
    print("kept" if alive() is not None else "released")
sim.synchronize()
sim.drain()
gc.collect()
print("kept" if alive() is not None else "released")
"""


@needs_sim
@pytest.mark.parametrize(
    ("make", "expected"),
    [
        ("te.device_result_cupy", ["kept", "released"]),
        ("te.device_result_torch", ["kept", "released"]),
        # Negative control: a bare handle handed to __dlpack__ by hand is released at once (the
        # default export policy: nothing says that stream outlives the export).
        ("lambda *a, **k: Imported(te.device_result(*a, **k).__dlpack__(stream=current.handle))", ["released"] * 2),
    ],
    ids=["cupy", "torch", "negative control"],
)
def test_a_framework_tagged_result_keeps_its_owner_until_the_frameworks_stream_is_done(make, expected):
    code = FRAMEWORK_CHILD.format(folder=str(_folder), make=make)
    result = run_python(code, HANDOFF_BACKEND=handoff.runtime_info()["backend"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == expected, result.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# NumPy arguments and results without a Python object of handoff's in between

NUMPY_ARGUMENTS = {
    "float32 2-d": np.arange(6, dtype=np.float32).reshape(2, 3),
    "column-major": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
    "reversed": np.arange(5, dtype=np.int16)[::-1],
    "every other": np.arange(10, dtype=np.uint32)[::2],
    "0-d": np.array(3, dtype=np.int64),
    "empty": np.zeros((0, 4), dtype=np.uint8),
    "bool": np.array([True, False]),
    "float16": np.ones(3, dtype=np.float16),
    "complex64": np.ones(2, dtype=np.complex64),
    "complex128": np.ones(2, dtype=np.complex128),
    "int8": np.ones(2, dtype=np.int8),
    "uint64": np.ones(2, dtype=np.uint64),
    "longlong": np.ones(2, dtype=np.longlong),
}


@pytest.mark.parametrize("values", NUMPY_ARGUMENTS.values(), ids=NUMPY_ARGUMENTS.keys())
def test_a_numpy_argument_is_what_its_dlpack_export_describes(values):
    # te.describe(values) reads the array's fields; handoff.asarray(values) imports its __dlpack__.
    assert te.describe(values) == te.describe(handoff.asarray(values))
    read_only = values.copy()
    read_only.flags.writeable = False
    assert te.describe(read_only)["readonly"] is True
    assert te.describe(read_only) == te.describe(handoff.asarray(read_only))


def test_a_numpy_argument_dlpack_refuses_raises_as_asarray_does():
    swapped = np.ones(3, dtype=">f4")
    odd_stride = np.lib.stride_tricks.as_strided(np.zeros(16, np.uint8).view(np.float32), shape=(2,), strides=(6,))
    for refused in (swapped, odd_stride, np.ones(2, dtype=np.longdouble)):
        with pytest.raises(Exception) as general:
            handoff.asarray(refused)
        with pytest.raises(type(general.value)):
            te.describe(refused)


def outcome(call, *arguments):
    """What a call returned, or the type of what it raised."""
    try:
        return call(*arguments)
    except Exception as error:  # noqa: BLE001 - the outcome is compared, whatever it is
        return type(error)


def test_a_numpy_array_over_pinned_memory_is_not_taken_for_host_memory():
    # NumPy's __dlpack_device__ reports the device of the DLPack capsule its data came from.
    class Pinned:
        def __init__(self) -> None:
            self.values = np.zeros(4, np.float32)
            self.tensor = HandMadeTensor(self.values.ctypes.data, (4,), device=(CUDA_HOST, 0))

        def __dlpack__(self, **kwargs):
            return self.tensor.capsule()

        def __dlpack_device__(self):
            return (CUDA_HOST, 0)

    producer = Pinned()
    pinned = np.from_dlpack(producer)
    assert pinned.__dlpack_device__() == (CUDA_HOST, 0)
    described, imported = outcome(te.describe, pinned), outcome(handoff.asarray, pinned)
    if isinstance(imported, handoff.Array):
        assert described["device"] == imported.device == (CUDA_HOST, 0)
    else:
        assert described is imported, "refused as asarray refuses it"
    # The tensor's deleter (a ctypes callback of `producer`) runs when the last release does, which
    # a device backend defers until its consumer stream is done: `producer` must outlive it.
    del pinned, imported
    gc.collect()
    if SIM:
        sim.synchronize()
        sim.drain()
    assert producer.tensor.deleted == 1


def test_a_numpy_subclass_is_asked_through_its_own_dlpack():
    class Counting(np.ndarray):
        calls = 0

        def __dlpack__(self, **kwargs):
            Counting.calls += 1
            return super().__dlpack__(**kwargs)

    values = np.ones(4, np.float32).view(Counting)
    assert te.sum(values) == 4.0
    assert Counting.calls == 1, "a subclass may override __dlpack__: the general import asks it"


def test_a_numpy_argument_is_counted_and_traced():
    values = np.ones(3, np.float32)
    before = handoff.stats()["imports"]
    assert te.sum(values) == 3.0
    assert handoff.stats()["imports"] == before + 1
    with handoff.trace() as trace:
        te.sum(values)
    imports = [event for event in trace.events if event["kind"] == "import"]
    assert len(imports) == 1
    assert (imports[0]["producer"], imports[0]["consumer"]) == ("numpy", "handoff::pybind")


def test_a_held_numpy_argument_keeps_the_array_alive_and_exports_its_memory(settled):
    values = np.arange(4, dtype=np.float32)
    address = values.ctypes.data
    watch = weakref.ref(values)
    kept = te.Held(values)
    del values
    gc.collect()
    assert watch() is not None, "the C++ object's array holds the NumPy array"
    exported = np.from_dlpack(kept)
    assert exported.ctypes.data == address and exported.tolist() == [0.0, 1.0, 2.0, 3.0]
    del kept, exported
    gc.collect()
    assert watch() is None


def test_an_argument_returned_as_numpy_is_the_same_memory(torch):
    values = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]
    again = te.as_numpy(values)
    # NumPy bases a view on the array that owns the memory, the argument's own base here.
    assert isinstance(again, np.ndarray) and again.base is values.base
    assert again.ctypes.data == values.ctypes.data and again.strides == values.strides
    assert again.tolist() == values.tolist() and again.flags.writeable
    tensor = torch.arange(4, dtype=torch.float64)
    from_torch = te.as_numpy(tensor)
    assert from_torch.ctypes.data == tensor.data_ptr() and from_torch.tolist() == [0.0, 1.0, 2.0, 3.0]
    watch = weakref.ref(tensor)
    del tensor
    gc.collect()
    assert watch() is not None, "the NumPy array's base holds the tensor"
    del from_torch
    gc.collect()
    assert watch() is None


def test_a_read_only_result_cannot_be_made_writable_through_its_base():
    values = np.zeros(3, np.float32)
    read_only = values[:]
    read_only.flags.writeable = False
    again = te.as_numpy(read_only)
    assert not again.flags.writeable
    with pytest.raises(ValueError, match="WRITEABLE"):
        again.flags.writeable = True


def test_read_only_data_is_refused_as_a_torch_tensor_which_would_be_writable(torch, settled):
    values = np.arange(3, dtype=np.float32)
    tensor = te.as_torch(values)
    assert isinstance(tensor, torch.Tensor) and tensor.data_ptr() == values.ctypes.data
    tensor[0] = 7.0
    assert values[0] == 7.0, "the same memory, writable as the argument is"
    values.flags.writeable = False
    with pytest.raises(BufferError, match="read-only data cannot be returned as a PyTorch array"):
        te.as_torch(values)
    assert values.tolist() == [7.0, 1.0, 2.0]


def test_an_empty_numpy_result_is_still_a_view_of_its_owner(settled):
    freed = te.buffers_freed()
    empty = te.arange_numpy(0)
    assert empty.shape == (0,) and type(empty.base).__name__ == "PyCapsule", "NumPy allocated nothing of its own"
    del empty
    gc.collect()
    assert te.buffers_freed() == freed + 1


def test_a_numpy_result_of_cpp_memory_is_based_on_its_owner(settled):
    freed = te.buffers_freed()
    made = te.arange_numpy(4)
    assert type(made.base).__name__ == "PyCapsule", "the owner the C++ code gave, not a wrapper"
    assert made.flags.writeable and made.flags.c_contiguous and made.flags.owndata is False
    assert made.dtype == np.float32 and made.tolist() == [0.0, 1.0, 2.0, 3.0]
    view = made[1:]
    del made
    gc.collect()
    assert te.buffers_freed() == freed, "a view of the result keeps the owner"
    del view
    gc.collect()
    assert te.buffers_freed() == freed + 1


def test_a_numpy_result_under_a_trace_is_recorded_as_an_export(settled):
    with handoff.trace() as trace:
        made = te.arange_numpy(3)
    assert made.tolist() == [0.0, 1.0, 2.0]
    assert any(event["kind"] == "export" for event in trace.events), "traced: through numpy.from_dlpack"


# ------------------------------------------------------------------------------------------------
# def_dlpack's methods


def test_def_dlpack_methods_take_dlpack_arguments_only():
    t = te.Tensor(1, 2, 1.0)
    with pytest.raises(TypeError):
        t.__dlpack__(None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'strem'"):
        t.__dlpack__(strem=None)
    with pytest.raises(TypeError):
        t.__dlpack_device__(1)
    with pytest.raises(TypeError, match=r"'__dlpack__' for 'tensor_example.Tensor' objects doesn't apply to a 'int'"):
        te.Tensor.__dlpack__(1)
    assert "DLPack capsule" in te.Tensor.__dlpack__.__doc__
    capsule = t.__dlpack__(stream=None, max_version=(1, 0), dl_device=(1, 0), copy=False)
    assert type(capsule).__name__ == "PyCapsule"


def test_a_describe_that_raises_propagates():
    held = te.Held(np.ones(2, np.float32))
    assert held.__dlpack_device__() == (1, 0)
    with pytest.raises(BufferError):  # the array API's copy=False where a copy is needed
        held.__dlpack__(dl_device=(2, 0), copy=False)


def test_a_def_dlpack_class_offers_the_c_exchange_api_in_both_forms(settled):
    assert te.Tensor.__c_dlpack_exchange_api__ == te.Held.__c_dlpack_exchange_api__, "one table for every class"
    assert te.Tensor.__c_dlpack_exchange_api__ == ctypes.addressof(exchange_api_of(te.Tensor))
    api = exchange_api_of(te.Tensor)
    t = te.Tensor(2, 3, 1.5)
    address = np.asarray(t).ctypes.data
    out = ctypes.POINTER(DLManagedTensorVersioned)()
    assert api.managed_tensor_from_py_object_no_sync(t, ctypes.byref(out)) == 0
    tensor = out.contents.dl_tensor
    assert tensor.data == address and [tensor.shape[i] for i in range(tensor.ndim)] == [2, 3]
    watch = weakref.ref(t)
    del t
    gc.collect()
    assert watch() is not None, "the tensor handed out keeps the instance"
    out.contents.deleter(out)
    gc.collect()
    assert watch() is None
    assert handoff.from_dlpack(te.Tensor(1, 2, 4.0)).shape == (1, 2), "handoff asks __dlpack__, not its own table"


def test_a_def_dlpack_class_leaves_the_slot_it_cannot_serve_null(settled):
    # An instance describes its memory on each call: no shape or strides outlive the call for a
    # DLTensor to borrow. The slot was published and always failed, so that a consumer preferring it
    # refused these objects; DLPack lets it be NULL.
    api = exchange_api_of(te.Tensor)
    assert not api.dltensor_from_py_object_no_sync, "a slot that always fails is published"
    assert exchange_api_of(handoff.Array).dltensor_from_py_object_no_sync, "handoff.Array's serves it"
    # managed_tensor_to_py_object_no_sync of the class's table makes a handoff.Array, not an instance.
    out = ctypes.POINTER(DLManagedTensorVersioned)()
    assert api.managed_tensor_from_py_object_no_sync(te.Tensor(1, 2, 4.0), ctypes.byref(out)) == 0
    made = ctypes.c_void_p()
    assert api.managed_tensor_to_py_object_no_sync(out, ctypes.byref(made)) == 0
    back = ctypes.cast(made, ctypes.py_object).value
    decref = ctypes.pythonapi["Py_DecRef"]
    decref.argtypes = [ctypes.c_void_p]
    decref(made)  # the call's new reference; `back` holds its own
    assert type(back) is handoff.Array and np.from_dlpack(back).tolist() == [[4.0, 4.0]]


@needs_sim
def test_a_def_dlpack_instance_handed_out_through_the_table_orders_the_work_stream(sim_streams):
    # Held describes a device array ready on `producer`; the table makes the work stream wait.
    # Negative control: test_negative_control_the_consumer_stream_races_without_the_import.
    producer, consumer = sim_streams
    with sim.hold(producer):
        pending = pending_write(producer, 1024)
        held = te.Held(
            handoff.view(pending.data_ptr, (1024,), "float32", device=pending.device, owner=pending, stream=producer)
        )
        out = ctypes.POINTER(DLManagedTensorVersioned)()
        with handoff.stream(consumer):
            assert exchange_api_of(te.Held).managed_tensor_from_py_object_no_sync(held, ctypes.byref(out)) == 0
        read = waiting_read(pending, consumer)
    assert read.result()[[0, -1]].tolist() == [1.0, 1.0]
    out.contents.deleter(out)
    del held
    sim.synchronize()
    sim.drain()  # the hand-out's release, deferred until the work stream was done
