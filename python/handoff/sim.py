"""The simulated accelerator: streams, arrays and delayed writes on the CPU, with CUDA's rules.

Available when ``HANDOFF_BACKEND=sim`` (arrays report as CUDA) or ``sim-rocm`` (as ROCm);
elsewhere every call raises :class:`handoff.DeviceError`. ``HANDOFF_SIM_DEVICES`` sets the number
of devices (default 2). A sim array's producer stream is the stream of its last enqueued write.

It is strict where CUDA is: captured work runs only when its Graph is launched, a sticky fault
halts its device, host functions run one at a time per device and may not call the runtime, and a
call that takes a destroyed stream or event raises :class:`handoff.DeviceError`
(``cudaErrorInvalidResourceHandle``) and is recorded in ``violations()``.

Tests order their races with ``hold``, never with a delay::

    with sim.hold(producer):               # nothing enqueued on producer in the block runs
        sim.fill(source, 1.0, stream=producer)
        view = handoff.from_dlpack(source, stream=consumer)
        read = sim.to_numpy(view, stream=consumer, wait=False)
        assert sim.waits_for_hold(consumer)  # the consumer waits for the producer
    assert read.result()[0] == 1.0         # the producer ran when the block ended

A wait on the holding thread for held work (``to_numpy`` with ``wait=True``, ``synchronize``,
``Stream.synchronize``, ``PendingCopy.result``, ``drain``) raises ``DeviceError``
(``handoffErrorHoldDeadlock``) instead of waiting for ever.
"""

import contextlib
from collections.abc import Iterator

from ._handoff._sim import (
    Graph,
    Hold,
    PendingCopy,
    Stream,
    _call_counts,
    _count_calls,
    begin_capture,
    clear_faults,
    clear_sticky_fault,
    clear_violations,
    current_device,
    drain,
    end_capture,
    fill,
    held,
    hold,
    inject_fault,
    inject_sticky_fault,
    launch,
    live_allocations,
    pending,
    reset_device,
    set_copy_delay,
    set_device,
    synchronize,
    synchronize_unheld,
    to_numpy,
    violations,
    waits_for_hold,
    zeros,
)

__all__ = [
    "Graph",
    "Hold",
    "PendingCopy",
    "Stream",
    "begin_capture",
    "clear_faults",
    "clear_sticky_fault",
    "clear_violations",
    "count_calls",
    "current_device",
    "drain",
    "end_capture",
    "fill",
    "held",
    "hold",
    "inject_fault",
    "inject_sticky_fault",
    "launch",
    "live_allocations",
    "pending",
    "reset_device",
    "set_copy_delay",
    "set_device",
    "synchronize",
    "synchronize_unheld",
    "to_numpy",
    "violations",
    "waits_for_hold",
    "zeros",
]


@contextlib.contextmanager
def count_calls() -> Iterator[dict[str, int]]:
    """Counts the simulated runtime calls the calling thread makes in the block, by operation.

    The dict it gives is filled as the block ends, each key an operation as ``inject_fault`` names it
    (``"record_event"``, ``"attributes"``, ...): what an exchange asks of the device, each operation
    one or two driver calls on a GPU (``"current_device"`` is the thread's current context). For
    tests that pin those questions. One block counts at a time; another, on any thread, raises::

        with sim.count_calls() as calls:
            view = handoff.from_dlpack(x, stream=consumer)
        assert calls["record_event"] == 1
    """
    counts: dict[str, int] = {}
    _count_calls(True)
    try:
        yield counts
    finally:
        _count_calls(False)
        counts.update(_call_counts())
