"""The contract's "Errors" paragraph: each error, its exception type, and a message naming the field."""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import os
import sys
import threading

import numpy as np
import pytest

import handoff

from dlpack_ctypes import CUDA, CUDA_HOST, CUDA_MANAGED, HandMadeTensor, capsule_name, new_capsule
from support import BACKEND, CUDA_ORDERING_REFUSED, cuda_is_usable, needs_sim, run_python

parse_cai = handoff._handoff._parse_cuda_array_interface

# --- byte order, dtypes, protocols -----------------------------------------------------------


class ArrayInterface:
    def __init__(self, interface: dict, keep: object = None) -> None:
        self.__array_interface__ = interface
        self._keep = keep


class CudaArrayInterface:
    def __init__(self, interface: dict) -> None:
        self.__cuda_array_interface__ = interface


def test_byte_swapped_array_is_a_buffer_error(live):
    a = np.arange(4, dtype=">f4")
    with pytest.raises(BufferError, match=r"typestr' '>f4' is byte-swapped"):
        handoff.asarray(a)
    with pytest.raises(BufferError):
        handoff.from_dlpack(a)  # NumPy refuses to export it


def test_byte_swapped_array_interface_is_a_buffer_error(live):
    a = np.arange(4, dtype=">i8")
    obj = ArrayInterface({"shape": (4,), "typestr": ">i8", "data": (a.ctypes.data, False), "version": 3}, a)
    with pytest.raises(BufferError, match=r"typestr' '>i8' is byte-swapped"):
        handoff.asarray(obj)


def test_byte_swapped_buffer_is_a_buffer_error(live):
    with pytest.raises(BufferError, match="byte-swapped"):
        handoff.asarray(memoryview(np.arange(4, dtype=">u2")))


def test_single_byte_types_have_no_byte_order(live):
    a = np.arange(4, dtype=np.int8)
    obj = ArrayInterface({"shape": (4,), "typestr": ">i1", "data": (a.ctypes.data, False), "version": 3}, a)
    assert handoff.asarray(obj).dtype == "int8"


@pytest.mark.parametrize("typestr", ["<U4", "|O8", "|V8", "<M8", "<m8", "|S4", "<f3", "<i16"])
def test_unexchangeable_typestr_is_a_buffer_error(typestr, live):
    a = np.zeros(64, dtype=np.uint8)
    obj = ArrayInterface({"shape": (2,), "typestr": typestr, "data": (a.ctypes.data, False), "version": 3}, a)
    with pytest.raises(BufferError, match=rf"typestr' '{typestr}'"):
        handoff.asarray(obj)


@pytest.mark.parametrize("typestr", ["f4", "<f", "", "<f-4", "xf4", "<f4x", "<f0"])
def test_malformed_typestr_is_a_value_error(typestr, live):
    a = np.zeros(8, dtype=np.float32)
    obj = ArrayInterface({"shape": (2,), "typestr": typestr, "data": (a.ctypes.data, False), "version": 3}, a)
    with pytest.raises(ValueError, match="typestr"):
        handoff.asarray(obj)


@pytest.mark.parametrize("a", [np.array(["ab", "cd"]), np.array([b"ab"]), np.array([object()]),
                               np.zeros(2, dtype="i4,f4"), np.zeros(2, dtype="M8[s]")])  # fmt: skip
def test_unsupported_numpy_dtypes_are_buffer_errors(a, live):
    with pytest.raises(BufferError):
        handoff.asarray(a)
    with pytest.raises(BufferError):
        handoff.from_dlpack(a)


@pytest.mark.parametrize("obj", [object(), 1, 1.5, "text", [1, 2, 3], None, {"shape": (1,)}])
def test_no_protocol_is_a_type_error(obj, live):
    with pytest.raises(TypeError, match="no array protocol"):
        handoff.asarray(obj)
    with pytest.raises(TypeError, match="__dlpack__"):
        handoff.from_dlpack(obj)


@needs_sim
def test_copy_false_when_a_copy_is_needed(live):
    from handoff import sim

    with pytest.raises(BufferError, match="copy=False"):
        handoff.asarray(sim.zeros(3), device=(1, 0), copy=False)  # device memory to the CPU


@pytest.mark.parametrize(("kw", "value"), [("copy", 1), ("copy", "yes"), ("device", 1), ("device", (1,))])
def test_ill_typed_keyword_arguments(kw, value, live):
    with pytest.raises(TypeError, match=kw):
        handoff.from_dlpack(np.arange(3.0), **{kw: value})
    with pytest.raises(TypeError, match=kw):
        handoff.asarray(np.arange(3.0), **{kw: value})


@pytest.mark.parametrize("device", [(0, 0), (19, 0), (1, -1), "cuda", "gpu"])
def test_unknown_devices_are_value_errors(device, live):
    with pytest.raises(ValueError, match="device"):
        handoff.from_dlpack(np.arange(3.0), device=device)


@pytest.mark.parametrize("stream", [True, False, 1.5, "1", object()])
def test_from_dlpack_stream_must_be_a_stream(stream, live):
    # The consumer stream is checked for every device, not only for those that order streams.
    with pytest.raises(TypeError, match="stream"):
        handoff.from_dlpack(np.arange(3.0), stream=stream)
    with pytest.raises(TypeError, match="stream"):
        handoff.asarray(np.arange(3.0), stream=stream)


@pytest.mark.parametrize("stream", [None, -1, 0, 1, 2, 7, handoff.Stream(5)])
def test_from_dlpack_any_valid_stream_for_cpu_data(stream, live):
    a = np.arange(3.0)
    assert handoff.from_dlpack(a, stream=stream).data_ptr == a.ctypes.data


def test_producer_returning_no_capsule_is_a_type_error(live):
    class NotACapsule:
        def __dlpack__(self, **kwargs):
            return 5

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError, match="expected a DLPack capsule, got int"):
        handoff.from_dlpack(NotACapsule())


@pytest.mark.parametrize(
    ("interface", "match"),
    [
        ({"shape": (4,), "typestr": "<f8", "offset": 8}, "reach outside"),
        ({"shape": (100,), "typestr": "<f8"}, "reach outside"),
        ({"shape": (2,), "typestr": "<f8", "offset": -8}, "'offset' -8"),
        ({"shape": (0,), "typestr": "<f8", "offset": 40}, "'offset' 40"),
        ({"shape": (2,), "typestr": "<f8", "strides": (-8,)}, "reach outside"),
        ({"shape": (2, 2), "typestr": "<f8", "strides": (16, 2**61)}, "reach outside"),
        ({"shape": (2,), "typestr": "<f8", "offset": "8"}, "'offset' must be an int"),
    ],
)
def test_array_interface_over_a_buffer_stays_inside_it(interface, match, live):
    raw = bytearray(32)
    with pytest.raises(ValueError, match=match):
        handoff.asarray(ArrayInterface({**interface, "data": raw, "version": 3}))


def test_array_interface_over_a_buffer_fits_exactly(live):
    raw = bytearray(np.arange(4, dtype=np.float64).tobytes())
    h = handoff.asarray(ArrayInterface({"shape": (2,), "typestr": "<f8", "data": raw, "offset": 16, "version": 3}))
    np.testing.assert_array_equal(np.asarray(h), [2.0, 3.0])
    h = handoff.asarray(ArrayInterface({"shape": (2,), "typestr": "<f8", "data": raw, "offset": 24,
                                        "strides": (-16,), "version": 3}))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(h), [3.0, 1.0])
    h = handoff.asarray(ArrayInterface({"shape": (0,), "typestr": "<f8", "data": raw, "offset": 32, "version": 3}))
    assert h.size == 0


# --- the CUDA Array Interface ----------------------------------------------------------------

BUFFER = np.zeros(64, dtype=np.float32)


def cai(**changes: object) -> dict:
    interface = {"shape": (2, 3), "typestr": "<f4", "data": (BUFFER.ctypes.data, False), "version": 3,
                 "strides": None, "stream": 1}  # fmt: skip
    for key, value in changes.items():
        if value is KeyError:
            del interface[key]
        else:
            interface[key] = value
    return interface


def test_valid_cuda_array_interfaces_parse():
    assert parse_cai(cai()) == ((2, 3), 1)
    assert parse_cai(cai(stream=None)) == ((2, 3), None)
    assert parse_cai(cai(stream=KeyError, version=2)) == ((2, 3), None)
    assert parse_cai(cai(strides=(12, 4))) == ((2, 3), 1)
    assert parse_cai(cai(shape=(0,), data=(0, False))) == ((0,), 1)  # empty: a null pointer is fine
    assert parse_cai(cai(shape=(), strides=KeyError)) == ((), 1)
    assert parse_cai(cai(version=0, stream=KeyError)) == ((2, 3), None)


MALFORMED = [
    pytest.param(cai(shape=KeyError), "shape", id="missing shape"),
    pytest.param(cai(typestr=KeyError), "typestr", id="missing typestr"),
    pytest.param(cai(data=KeyError), "data", id="missing data"),
    pytest.param(cai(version=KeyError), "version", id="missing version"),
    pytest.param(cai(shape=[2, 3]), "shape", id="shape list"),
    pytest.param(cai(shape=(2, "3")), "shape", id="shape str item"),
    pytest.param(cai(shape=(2, 3.0)), "shape", id="shape float item"),
    pytest.param(cai(shape=(True,)), "shape", id="shape bool item"),
    pytest.param(cai(shape=2), "shape", id="shape int"),
    pytest.param(cai(typestr=b"<f4"), "typestr", id="typestr bytes"),
    pytest.param(cai(typestr="float32"), "typestr", id="typestr name"),
    pytest.param(cai(data=[BUFFER.ctypes.data, False]), "data", id="data list"),
    pytest.param(cai(data=(BUFFER.ctypes.data,)), "data", id="data 1-tuple"),
    pytest.param(cai(data=(float(BUFFER.ctypes.data), False)), "data", id="data float"),
    pytest.param(cai(data=(BUFFER.ctypes.data, 0)), "data", id="readonly int"),
    pytest.param(cai(data=(-4096, False)), "data", id="negative pointer"),
    pytest.param(cai(data=(2**64, False)), "data", id="pointer too large"),
    pytest.param(cai(version="3"), "version", id="version str"),
    pytest.param(cai(version=4), "version", id="version 4"),
    pytest.param(cai(version=-1), "version", id="version -1"),
    pytest.param(cai(shape=(-1, 3)), "shape", id="negative shape"),
    pytest.param(cai(shape=(2, -3), strides=(12, 4)), "shape", id="negative shape with strides"),
    pytest.param(cai(strides=(4,)), "strides", id="strides too short"),
    pytest.param(cai(strides=(12, 4, 4)), "strides", id="strides too long"),
    pytest.param(cai(strides=[12, 4]), "strides", id="strides list"),
    pytest.param(cai(strides=(12, 4.0)), "strides", id="strides float"),
    pytest.param(cai(shape=(2**62, 4)), "shape", id="size overflows"),
    pytest.param(cai(shape=(2**31, 2**31, 2**31)), "shape", id="element count overflows"),
    pytest.param(cai(shape=(2**64,)), "shape", id="extent out of int64"),
    pytest.param(cai(shape=(3, 3), strides=(2**62, 4)), "strides", id="element offset overflows"),
    pytest.param(cai(data=(0, False)), "data", id="null pointer"),
    pytest.param(cai(stream=0), "stream", id="stream 0"),
    pytest.param(cai(stream=-2), "stream", id="stream -2"),
    pytest.param(cai(stream="1"), "stream", id="stream str"),
    pytest.param(cai(stream=True), "stream", id="stream bool"),
]


@pytest.mark.parametrize(("interface", "field"), MALFORMED)
def test_malformed_cuda_array_interface_is_a_value_error(interface, field, live):
    with pytest.raises(ValueError, match=rf"__cuda_array_interface__.*'?{field}"):
        parse_cai(interface)
    with pytest.raises(ValueError, match=rf"__cuda_array_interface__.*'?{field}"):
        handoff.asarray(CudaArrayInterface(interface))


def test_cuda_array_interface_must_be_a_dict(live):
    with pytest.raises(ValueError, match="__cuda_array_interface__ must be a dict"):
        parse_cai([("shape", (1,))])


def test_mask_is_not_implemented(live):
    with pytest.raises(NotImplementedError, match="mask"):
        parse_cai(cai(mask=BUFFER))
    with pytest.raises(NotImplementedError, match="mask"):
        handoff.asarray(CudaArrayInterface(cai(mask=BUFFER)))
    a = np.arange(4.0)
    obj = ArrayInterface({**a.__array_interface__, "mask": np.ones(4, bool)}, a)
    with pytest.raises(NotImplementedError, match="__array_interface__ with a mask"):
        handoff.asarray(obj)
    assert handoff.asarray(ArrayInterface({**a.__array_interface__, "mask": None}, a)).data_ptr == a.ctypes.data


def test_array_interface_version_must_be_3(live):
    a = np.arange(4.0)
    with pytest.raises(ValueError, match="__array_interface__ 'version'"):
        handoff.asarray(ArrayInterface({**a.__array_interface__, "version": 2}, a))


@pytest.mark.parametrize("name", ["__array_interface__", "__cuda_array_interface__"])
def test_interface_property_that_raises_propagates(name, live):
    def broken(self):
        raise KeyError("the interface could not be made")

    obj = type("Broken", (), {name: property(broken)})()
    with pytest.raises(KeyError, match="could not be made"):
        handoff.asarray(obj)


@pytest.mark.parametrize("name", ["__array_interface__", "__cuda_array_interface__"])
def test_interface_property_raising_attribute_error_is_no_protocol(name, live):
    def absent(self):
        raise AttributeError(name)

    obj = type("Absent", (), {name: property(absent)})()
    with pytest.raises(TypeError, match="no array protocol"):
        handoff.asarray(obj)


@pytest.mark.parametrize("data", [KeyError, None, 5, 1.5, [1, 2], "text"])
def test_array_interface_without_usable_data_is_a_value_error(data, live):
    interface = {"shape": (2,), "typestr": "<f4", "version": 3}
    if data is not KeyError:
        interface["data"] = data
    with pytest.raises(ValueError, match=r"__array_interface__.*'data'"):
        handoff.asarray(ArrayInterface(interface))  # an object without a buffer of its own


def test_size_one_axis_may_have_any_stride(live):
    # NumPy allows any stride on an axis of extent 1 (it never moves); handoff makes it contiguous.
    a = np.arange(6, dtype=np.float32).reshape(2, 1, 3)
    h = handoff.asarray(ArrayInterface({**a.__array_interface__, "strides": (12, 7, 4)}, a))
    assert h.shape == (2, 1, 3) and h.strides == (12, 12, 4)
    np.testing.assert_array_equal(np.asarray(h), a)
    odd = np.lib.stride_tricks.as_strided(a, shape=(2, 1, 3), strides=(12, 7, 4))
    h = handoff.asarray(memoryview(odd))
    assert h.strides == (12, 12, 4)
    np.testing.assert_array_equal(np.asarray(h), a)
    assert parse_cai(cai(shape=(2, 1, 3), strides=(12, 5, 4))) == ((2, 1, 3), 1)
    with pytest.raises(BufferError, match=r"'strides'\[1\] = 5 is not a multiple"):
        parse_cai(cai(shape=(2, 2, 3), strides=(24, 5, 4)))


def test_valid_cuda_array_interface_without_a_device_is_a_device_error(live):
    if BACKEND != "none":
        pytest.skip("a device backend is active")
    with pytest.raises(handoff.DeviceError, match="__cuda_array_interface__") as caught:
        handoff.asarray(CudaArrayInterface(cai()))
    assert isinstance(caught.value, RuntimeError)
    assert caught.value.error_name == "handoffErrorNoBackend"
    assert caught.value.backend == "none"


class CudaProducer:
    """Hands out `tensor`, saying where it is, and records the stream values it was asked for."""

    def __init__(self, tensor: HandMadeTensor) -> None:
        self.tensor = tensor
        self.streams: list = []

    def __dlpack_device__(self) -> tuple[int, int]:
        device = self.tensor.managed.dl_tensor.device
        return (device.device_type, device.device_id)

    def __dlpack__(self, *, stream=None, **_):
        self.streams.append(stream)
        return self.tensor.capsule()


class DeviceHidingProducer:
    """A producer older than __dlpack_device__: nothing says where its data is before the capsule."""

    def __init__(self, tensor: HandMadeTensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, **_):
        return self.tensor.capsule()


needs_auto_without_cuda = pytest.mark.skipif(
    not CUDA_ORDERING_REFUSED, reason="needs HANDOFF_BACKEND=auto on a machine where CUDA cannot start"
)


@needs_auto_without_cuda
@pytest.mark.parametrize("entry", [handoff.from_dlpack, handoff.asarray])
@pytest.mark.parametrize("make_producer", [CudaProducer, DeviceHidingProducer, HandMadeTensor.capsule])
@pytest.mark.parametrize("device_type", [CUDA, CUDA_HOST, CUDA_MANAGED])
def test_cuda_data_nothing_can_order_is_refused_not_exchanged_unordered(entry, make_producer, device_type, live):
    data = np.zeros(4, np.float32)
    tensor = HandMadeTensor(data.ctypes.data, (4,), device=(device_type, 0))
    with pytest.raises(handoff.DeviceError, match="HANDOFF_BACKEND=auto could not start the CUDA backend") as caught:
        entry(make_producer(tensor))
    info = handoff.runtime_info()
    assert caught.value.backend == "cuda"
    assert caught.value.error_name in ("cudaErrorInsufficientDriver", "cudaErrorNoDevice", "handoffErrorNoBackend")
    assert info["backend_error"] in str(caught.value)
    gc.collect()
    assert tensor.deleted == 1, "the refused import must release the producer exactly once"


@needs_auto_without_cuda
def test_cuda_data_is_imported_where_the_consumer_orders_its_work_itself(live):
    data = np.zeros(4, np.float32)
    producer = CudaProducer(HandMadeTensor(data.ctypes.data, (4,), device=(CUDA, 0)))
    view = handoff.from_dlpack(producer, stream=-1)
    assert producer.streams == [-1]
    assert view.device == (CUDA, 0) and view.data_ptr == data.ctypes.data
    del view
    gc.collect()
    assert producer.tensor.deleted == 1


def test_handoff_backend_none_exchanges_cuda_data_unordered_as_asked():
    result = run_python(
        "import sys, numpy as np, handoff\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from dlpack_ctypes import HandMadeTensor\n"
        "data = np.zeros(4, np.float32)\n"
        "tensor = HandMadeTensor(data.ctypes.data, (4,), device=(2, 0))\n"
        "view = handoff.from_dlpack(tensor.capsule())\n"
        "print(handoff.runtime_info()['backend'], view.device)\n",
        HANDOFF_BACKEND="none",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["none", "(2,", "0)"]


# --- capsules --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_version", [None, (1, 1)])
def test_capsule_consumed_twice_is_a_value_error(max_version, live):
    a = np.arange(3.0)
    capsule = a.__dlpack__(max_version=max_version)
    h = handoff.from_dlpack(capsule)
    with pytest.raises(ValueError, match="already consumed"):
        handoff.from_dlpack(capsule)
    with pytest.raises(ValueError, match="already consumed"):
        handoff.asarray(capsule)
    assert h.data_ptr == a.ctypes.data
    np.testing.assert_array_equal(np.from_dlpack(h), a)


def test_non_dlpack_capsule_is_a_type_error(live):
    with pytest.raises(TypeError, match=r"datetime.datetime_CAPI.*not a DLPack capsule"):
        handoff.from_dlpack(datetime.datetime_CAPI)
    target = ctypes.c_int(0)
    with pytest.raises(TypeError, match="not a DLPack capsule"):
        handoff.from_dlpack(new_capsule(ctypes.addressof(target), None))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"code": 99}, BufferError, "dtype"),
        ({"bits": 24}, BufferError, "dtype"),
        ({"major": 2}, BufferError, "major version"),
        ({"null_shape": True}, ValueError, "null shape"),
        ({"code": 2, "bits": 4}, BufferError, "sub-byte"),
    ],
)
def test_refused_tensor_runs_its_deleter_once(kwargs, error, match, live):
    data = np.zeros(8, dtype=np.float32)
    tensor = HandMadeTensor(data.ctypes.data, (2, 3), **kwargs)
    capsule = tensor.capsule()
    with pytest.raises(error, match=match):
        handoff.from_dlpack(capsule)
    assert tensor.deleted == 1
    assert capsule_name(capsule) == "used_dltensor_versioned"
    with pytest.raises(ValueError, match="already consumed"):
        handoff.from_dlpack(capsule)
    assert tensor.deleted == 1


def test_negative_shape_in_a_tensor_is_a_value_error(live):
    tensor = HandMadeTensor(np.zeros(4).ctypes.data, (2, -3))
    with pytest.raises(ValueError, match=r"shape\[1\]"):
        handoff.from_dlpack(tensor.capsule())
    assert tensor.deleted == 1


def test_tensor_refused_after_import_runs_its_deleter_once(live):
    data = np.zeros(6, dtype=np.float32)
    tensor = HandMadeTensor(data.ctypes.data, (2, 3))
    with pytest.raises(BufferError, match=r"\(2, 0\)"):
        handoff.from_dlpack(tensor.capsule(), device=(2, 0))
    assert tensor.deleted == 1


def test_tensor_copied_at_import_is_released_at_once(live):
    data = np.arange(6, dtype=np.float32)
    tensor = HandMadeTensor(data.ctypes.data, (2, 3))
    h = handoff.from_dlpack(tensor.capsule(), copy=True)
    assert tensor.deleted == 1  # the copy owns its memory; the producer is not needed any more
    assert h.data_ptr != data.ctypes.data
    data[:] = -1
    np.testing.assert_array_equal(np.from_dlpack(h).ravel(), np.arange(6, dtype=np.float32))


def test_accepted_tensor_runs_its_deleter_once_when_released(live):
    data = np.arange(6, dtype=np.float32)
    tensor = HandMadeTensor(data.ctypes.data, (2, 3))
    h = handoff.from_dlpack(tensor.capsule())
    b = np.from_dlpack(h)
    del h
    assert tensor.deleted == 0
    np.testing.assert_array_equal(b.ravel(), data)
    del b
    assert tensor.deleted == 1


# --- device errors and the runtime -----------------------------------------------------------


def test_cuda_backend_by_name_fails_at_first_use():
    if cuda_is_usable():
        pytest.skip("a CUDA device is usable here")
    code = """
import json, numpy as np, handoff
info = handoff.runtime_info()
ok = handoff.from_dlpack(np.arange(3.0)).data_ptr != 0  # CPU exchange needs no device
class C:
    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (4096, False), "version": 3}
try:
    handoff.asarray(C())
except handoff.DeviceError as e:
    print(json.dumps({"info": info, "ok": ok, "error_name": e.error_name, "backend": e.backend,
                      "message": str(e), "runtime": isinstance(e, RuntimeError)}))
"""
    result = run_python(code, HANDOFF_BACKEND="cuda")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["info"]["backend"] == "cuda"
    assert "cudaErrorInsufficientDriver" in out["info"]["backend_error"] or not out["info"]["cuda_compiled"]
    assert out["ok"]
    assert out["runtime"]
    if out["info"]["cuda_compiled"]:
        assert out["error_name"] == "cudaErrorInsufficientDriver"
        assert "cudaErrorInsufficientDriver" in out["message"]
    assert out["backend"] == "cuda"


def test_unknown_backend_fails_at_first_use():
    code = """
import handoff
class C:
    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (4096, False), "version": 3}
try:
    handoff.asarray(C())
except handoff.DeviceError as e:
    print(e.error_name)
"""
    result = run_python(code, HANDOFF_BACKEND="no-such-backend")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "handoffErrorInvalidBackend"


def test_runtime_info():
    info = handoff.runtime_info()
    assert info["backend"] in {"cuda", "sim", "sim-rocm", "none"}
    assert isinstance(info["device_count"], int) and info["device_count"] >= 0
    assert info["version"] == handoff.__version__
    assert info["dlpack_version"] == "1.1"
    if info["backend"] == "none":
        assert info["device_count"] == 0


STATS_KEYS = {"exports", "imports", "waits_inserted", "waits_elided", "events_created", "events_reused",
              "deferred_releases", "live_views"}  # fmt: skip


def test_stats_keys_and_reset(live):
    stats = handoff.stats()
    assert set(stats) >= STATS_KEYS
    assert all(isinstance(v, int) for v in stats.values())
    a = np.arange(3.0)
    h = handoff.from_dlpack(a)
    capsule = h.__dlpack__()
    s = handoff.stats()
    assert s["imports"] >= 1 and s["exports"] >= 1
    live_before = s["live_views"]
    handoff.reset_stats()
    s = handoff.stats()
    assert all(s[k] == 0 for k in STATS_KEYS - {"live_views"})
    assert s["live_views"] == live_before  # still counting what is alive
    h2 = handoff.from_dlpack(capsule)
    s = handoff.stats()
    assert (s["imports"], s["exports"]) == (1, 0)
    del h, h2, capsule


def test_stats_count_every_exchange_of_concurrent_threads():
    # Imports and exports are counted with no atomic update: the GIL orders them.
    threads, rounds = 8, 2000
    source = np.arange(4.0)
    barrier = threading.Barrier(threads)

    def exchange():
        barrier.wait()
        for _ in range(rounds):
            handoff.from_dlpack(source).__dlpack__()

    before = handoff.stats()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns as often as they can
    try:
        workers = [threading.Thread(target=exchange) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    after = handoff.stats()
    assert after["imports"] - before["imports"] == threads * rounds
    assert after["exports"] - before["exports"] == threads * rounds


@pytest.mark.parametrize("setting", ["none", "auto"])
def test_the_simulator_without_its_backend_says_what_to_set(setting):
    if setting == "auto" and cuda_is_usable():
        pytest.skip("with a usable CUDA device, auto starts the CUDA backend (the message then names it)")
    code = "from handoff import sim\ntry:\n    sim.Stream()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    out = run_python(code, HANDOFF_BACKEND=setting)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("DeviceError handoff.sim runs on the simulated device: set HANDOFF_BACKEND=sim")
    assert f"HANDOFF_BACKEND={setting}" in out.stdout  # and what the process runs instead


class AskedProducer:
    """Device data whose producer records every __dlpack__ call (a producer that refuses a stream in
    its own words, as PyTorch asserts, or not at all)."""

    def __init__(self, device: tuple[int, int]) -> None:
        self.device = device
        self.asked: list[dict[str, object]] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **kwargs: object) -> object:
        self.asked.append(kwargs)
        raise AssertionError(f"unsupported stream: {kwargs.get('stream')}")


@pytest.mark.parametrize(
    ("device", "stream"),
    [((2, 0), 0), ((2, 0), -2), ((13, 0), 0), ((10, 0), 1), ((10, 0), 2), ((10, 0), -7)],
    ids=["cuda-0", "cuda-negative", "managed-0", "rocm-1", "rocm-2", "rocm-negative"],
)
def test_an_invalid_consumer_stream_is_a_value_error_before_the_producer_is_asked(device, stream):
    producer = AskedProducer(device)
    with pytest.raises(ValueError, match=f"stream={stream} is invalid for a"):
        handoff.from_dlpack(producer, stream=stream)
    assert producer.asked == []
