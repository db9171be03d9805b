"""The simulated accelerator: streams, arrays and delayed writes on the CPU, with CUDA's rules.

Available when ``HANDOFF_BACKEND=sim`` (arrays report as CUDA) or ``sim-rocm`` (as ROCm);
elsewhere every call raises :class:`handoff.DeviceError`. ``HANDOFF_SIM_DEVICES`` sets the number
of devices (default 2). A sim array's producer stream is the stream of its last enqueued write.
"""

from ._handoff._sim import (
    Stream,
    begin_capture,
    clear_faults,
    drain,
    end_capture,
    fill,
    inject_fault,
    live_allocations,
    set_copy_delay,
    synchronize,
    to_numpy,
    zeros,
)

__all__ = [
    "Stream",
    "begin_capture",
    "clear_faults",
    "drain",
    "end_capture",
    "fill",
    "inject_fault",
    "live_allocations",
    "set_copy_delay",
    "synchronize",
    "to_numpy",
    "zeros",
]
