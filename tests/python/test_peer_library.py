"""The PyTorch-like peer library of the tests (peer_library.py) against PyTorch 2.13's own code: its
current streams per thread and per device, and ``from_dlpack``'s calls to a producer, retries and
errors, compared with ``torch.from_dlpack``'s where the CPU build of PyTorch can make them."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from support import DEFAULT_STREAM, DEVICE_TYPE, SIM_ROCM, needs_sim, needs_two_devices

pytestmark = needs_sim


@pytest.fixture
def torchlike():
    from peer_library import make_library

    return make_library("simtorchmock", register=False)


class Recording:
    """A producer that lists the arguments of each call to its `__dlpack__`, refuses those named in
    `refuses` with a TypeError (as a producer of an older DLPack does), and exports `data`."""

    def __init__(self, data: Any, device: tuple[int, int], refuses: tuple[str, ...] = ()) -> None:
        self.data, self.device, self.refuses, self.calls = data, device, refuses, []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(dict(kwargs))
        refused = [name for name in self.refuses if name in kwargs]
        if refused:
            raise TypeError(f"__dlpack__() got an unexpected keyword argument {refused[0]!r}")
        if isinstance(self.data, np.ndarray):
            return self.data.__dlpack__(**kwargs)
        return self.data.__dlpack__(stream=-1, max_version=kwargs.get("max_version"))


def device_data() -> Recording:
    from handoff import sim

    return Recording(sim.zeros(4, "float32"), (DEVICE_TYPE, 0))


def test_a_current_stream_set_on_one_thread_is_not_another_threads(torchlike):
    from handoff import sim

    consumer, own = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    passed: dict[str, object] = {}

    def other_thread() -> None:
        producer = device_data()
        torchlike.from_dlpack(producer)
        passed["other thread"] = producer.calls[-1]["stream"]
        with torchlike.use(own):
            torchlike.from_dlpack(producer)
            passed["other thread, its own stream"] = producer.calls[-1]["stream"]

    with torchlike.use(consumer):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        producer = device_data()
        torchlike.from_dlpack(producer)
        passed["this thread"] = producer.calls[-1]["stream"]
    assert passed == {
        "other thread": DEFAULT_STREAM,  # torch.cuda.current_stream is per thread
        "other thread, its own stream": own.handle,
        "this thread": consumer.handle,  # the other thread's stream did not replace this one's
    }


@needs_two_devices
def test_a_current_stream_is_that_of_its_device(torchlike):
    from handoff import sim

    far = sim.Stream(1, non_blocking=True)
    producer = device_data()  # on device 0
    with torchlike.use(far):
        assert torchlike.current_stream(1) is far and torchlike.current_stream(0) is None
        torchlike.from_dlpack(producer)
    assert producer.calls[-1]["stream"] == DEFAULT_STREAM, "the current stream of the data's device"


REFUSALS = [(), ("max_version",), ("max_version", "copy"), ("max_version", "copy", "dl_device")]


@pytest.mark.parametrize("refuses", REFUSALS, ids=lambda r: "refuses " + ",".join(r) if r else "takes all")
@pytest.mark.parametrize("copy", [None, True, False])
@pytest.mark.parametrize("device", [None, "cpu"])
def test_from_dlpack_asks_a_producer_as_torch_does(torch, torchlike, refuses, copy, device):
    outcomes = []
    for from_dlpack in (torch.from_dlpack, torchlike.from_dlpack):
        data = np.arange(4.0)
        producer = Recording(data, (1, 0), refuses)
        try:
            result = from_dlpack(producer, device=device, copy=copy)
        except TypeError as e:  # every retry refused: the last refusal
            outcomes.append((producer.calls, repr(e)))
            continue
        pointer = result.data_ptr() if isinstance(result, torch.Tensor) else result._data.data_ptr
        outcomes.append((producer.calls, pointer == data.ctypes.data))  # shared, or a copy
    assert outcomes[1] == outcomes[0]


def test_from_dlpack_refuses_as_torch_does(torch, torchlike):
    capsule_of = lambda: np.arange(4.0).__dlpack__()  # noqa: E731 - a fresh capsule each time
    cases = {
        "a capsule with copy": lambda f: f(capsule_of(), copy=True),
        "a capsule with device": lambda f: f(capsule_of(), device="cpu"),
        "a device that is no device": lambda f: f(Recording(np.arange(4.0), (1, 0)), device=0),
        "a move without a copy": lambda f: f(Recording(np.arange(4.0), (1, 0)), device="cuda:0", copy=False),
    }
    for name, case in cases.items():
        errors = []
        for from_dlpack in (torch.from_dlpack, torchlike.from_dlpack):
            with pytest.raises(Exception) as raised:  # any: the type is compared below
                case(from_dlpack)
            errors.append((type(raised.value), str(raised.value)))
        if SIM_ROCM and name == "a move without a copy":  # the mock's "cuda" is ROCm's device type
            errors = [(kind, message.split(" to ")[0]) for kind, message in errors]
        assert errors[1] == errors[0], name
