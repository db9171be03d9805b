"""The contract's DLPack stream table, cell by cell, and the CPU column through the real export."""

from __future__ import annotations

import numpy as np
import pytest

import handoff

from dlpack_ctypes import (
    CPU,
    CUDA,
    CUDA_HOST,
    CUDA_MANAGED,
    EXT_DEV,
    METAL,
    ONEAPI,
    OPENCL,
    ROCM,
    ROCM_HOST,
    TRN,
    VULKAN,
)

classify = handoff._handoff._classify_stream

CUDA_LIKE = [CUDA, CUDA_HOST, CUDA_MANAGED]
ROCM_LIKE = [ROCM, ROCM_HOST]
CPU_LIKE = [CPU, OPENCL, VULKAN, METAL, EXT_DEV, ONEAPI, TRN, 99]

HANDLES = [3, 4, 0x7F00_0000_1000, 2**63 - 1]
OTHER = [-2, -3, -(2**63)]


# --- CUDA, CUDA host, CUDA managed -----------------------------------------------------------


@pytest.mark.parametrize("device", CUDA_LIKE)
@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, ("legacy_default", 0)), (-1, ("none", 0)), (1, ("legacy_default", 0)), (2, ("per_thread_default", 0))],
)
def test_cuda_special_values(device, value, expected):
    assert classify(device, value) == expected


@pytest.mark.parametrize("device", CUDA_LIKE + ROCM_LIKE)
@pytest.mark.parametrize("handle", HANDLES)
def test_cuda_and_rocm_handle_is_that_stream(device, handle):
    assert classify(device, handle) == ("handle", handle)


@pytest.mark.parametrize("device", CUDA_LIKE)
def test_cuda_zero_is_ambiguous(device):
    with pytest.raises(ValueError, match=r"stream=0"):
        classify(device, 0)


@pytest.mark.parametrize("device", CUDA_LIKE)
@pytest.mark.parametrize("value", OTHER)
def test_cuda_other_values(device, value):
    with pytest.raises(ValueError, match=rf"stream={value}\b"):
        classify(device, value)


# --- ROCm, ROCm host -------------------------------------------------------------------------


@pytest.mark.parametrize("device", ROCM_LIKE)
@pytest.mark.parametrize(
    ("value", "expected"), [(None, ("default_stream", 0)), (-1, ("none", 0)), (0, ("default_stream", 0))]
)
def test_rocm_special_values(device, value, expected):
    assert classify(device, value) == expected


@pytest.mark.parametrize("device", ROCM_LIKE)
@pytest.mark.parametrize("value", [1, 2, *OTHER])
def test_rocm_refused_values(device, value):
    with pytest.raises(ValueError, match=rf"stream={value}\b.*ROCm"):
        classify(device, value)


# --- CPU and every other device --------------------------------------------------------------


@pytest.mark.parametrize("device", CPU_LIKE)
def test_cpu_like_none_is_no_ordering(device):
    assert classify(device, None) == ("none", 0)


@pytest.mark.parametrize("device", CPU_LIKE)
@pytest.mark.parametrize("value", [-1, 0, 1, 2, *HANDLES, *OTHER])
def test_cpu_like_refuses_every_integer(device, value):
    with pytest.raises(ValueError, match=rf"stream={value}\b"):
        classify(device, value)


# --- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [CPU, CUDA, CUDA_HOST, CUDA_MANAGED, ROCM, ROCM_HOST, OPENCL])
@pytest.mark.parametrize("value", [True, False, 1.0, 1.5, "1", b"1", (1,), object()])
def test_bool_and_non_integers_are_type_errors(device, value):
    with pytest.raises(TypeError, match="stream"):
        classify(device, value)


@pytest.mark.parametrize("device", [CPU, CUDA, ROCM])
@pytest.mark.parametrize("value", [2**63, 2**64, -(2**63) - 1])
def test_integers_outside_int64_are_value_errors(device, value):
    with pytest.raises(ValueError, match="out of range"):
        classify(device, value)


# --- the CPU column through handoff.Array.__dlpack__ -----------------------------------------


@pytest.fixture
def cpu_array():
    return handoff.from_dlpack(np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("max_version", [None, (1, 0), (1, 1)])
def test_cpu_export_with_stream_none(cpu_array, max_version):
    capsule = cpu_array.__dlpack__(stream=None, max_version=max_version)
    back = np.from_dlpack(handoff.from_dlpack(capsule))
    np.testing.assert_array_equal(back, np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("value", [-1, 0, 1, 2, 3, 2**40])
@pytest.mark.parametrize("max_version", [None, (1, 1)])
def test_cpu_export_refuses_integer_streams(cpu_array, value, max_version, live):
    exports = handoff.stats()["exports"]
    with pytest.raises(ValueError, match=rf"stream={value}\b.*CPU"):
        cpu_array.__dlpack__(stream=value, max_version=max_version)
    assert handoff.stats()["exports"] == exports


@pytest.mark.parametrize("value", [True, False, 1.5, "1", None.__class__])
def test_cpu_export_refuses_non_integer_streams(cpu_array, value):
    with pytest.raises(TypeError, match="stream"):
        cpu_array.__dlpack__(stream=value)


def test_numpy_consumer_passes_no_stream_for_cpu(cpu_array):
    # NumPy calls __dlpack__ without a stream for CPU data; handoff must accept that call.
    out = np.from_dlpack(cpu_array)
    assert out.ctypes.data == cpu_array.data_ptr
