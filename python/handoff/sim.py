"""The simulated accelerator: streams, arrays and delayed writes on the CPU, with CUDA's rules.

Available when ``HANDOFF_BACKEND=sim`` (arrays report as CUDA) or ``sim-rocm`` (as ROCm);
elsewhere every call raises :class:`handoff.DeviceError`. ``HANDOFF_SIM_DEVICES`` sets the number
of devices (default 2). A sim array's producer stream is the stream of its last enqueued write.

It is strict where CUDA is: captured work runs only when its Graph is launched, a sticky fault
halts its device, host functions run one at a time per device and may not call the runtime, and a
use of a destroyed stream or event is recorded in ``violations()``.
"""

from ._handoff._sim import (
    Graph,
    Stream,
    begin_capture,
    clear_faults,
    clear_sticky_fault,
    clear_violations,
    current_device,
    drain,
    end_capture,
    fill,
    inject_fault,
    inject_sticky_fault,
    launch,
    live_allocations,
    reset_device,
    set_copy_delay,
    set_device,
    synchronize,
    to_numpy,
    violations,
    zeros,
)

__all__ = [
    "Graph",
    "Stream",
    "begin_capture",
    "clear_faults",
    "clear_sticky_fault",
    "clear_violations",
    "current_device",
    "drain",
    "end_capture",
    "fill",
    "inject_fault",
    "inject_sticky_fault",
    "launch",
    "live_allocations",
    "reset_device",
    "set_copy_delay",
    "set_device",
    "synchronize",
    "to_numpy",
    "violations",
    "zeros",
]
