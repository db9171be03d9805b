"""handoff: zero-copy array exchange between GPU libraries, with the streams ordered.

Import any array (DLPack, CUDA Array Interface, ``__array_interface__``, buffer protocol) as a
:class:`handoff.Array` and pass it on to any framework; handoff orders the producer's pending work
before the consumer's stream without blocking the host.
"""

from ._handoff import (
    Array,
    DeviceError,
    __version__,
    asarray,
    from_dlpack,
    reset_stats,
    runtime_info,
    stats,
    view,
)
from ._exporter import Exporter
from ._streams import Stream, as_stream, current_stream, stream

import atexit as _atexit

from ._handoff import _at_exit

# Threads still inside handoff's device calls must not take the GIL back while Python finalizes,
# and releases waiting for a consumer stream run producers' deleters: both while Python is alive.
_atexit.register(_at_exit)

__all__ = [
    "Array",
    "DeviceError",
    "Exporter",
    "Stream",
    "__version__",
    "as_stream",
    "asarray",
    "current_stream",
    "from_dlpack",
    "reset_stats",
    "runtime_info",
    "stats",
    "stream",
    "view",
]
