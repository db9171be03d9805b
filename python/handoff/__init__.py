"""handoff: zero-copy array exchange between GPU libraries, with the streams ordered.

Import any array (DLPack, CUDA Array Interface, ``__array_interface__``, buffer protocol) as a
:class:`handoff.Array` and pass it on to any framework; handoff orders the producer's pending work
before the consumer's stream without blocking the host.
"""

import importlib as _importlib


def _refuse_sub_interpreters() -> None:
    """handoff's runtime is one per process, and its extension's module state is not per interpreter:
    initialized in a sub-interpreter (mod_wsgi, embedders) it would deadlock on the GIL's thread state."""
    for name in ("_interpreters", "_xxsubinterpreters"):  # Python 3.13 and later; 3.8 to 3.12
        try:
            interpreters = _importlib.import_module(name)
        except ImportError:
            continue
        if interpreters.get_current() != interpreters.get_main():
            raise ImportError(
                "handoff cannot be imported in a sub-interpreter: its runtime serves the main interpreter only "
                "(import it there, or run the work in a separate process)"
            )
        return


_refuse_sub_interpreters()

import atexit as _atexit
import os as _os
from pathlib import Path as _Path

from . import ipc
from ._exporter import Exporter
from ._graph import ownership_graph
from ._handoff import (
    Array,
    DeviceError,
    __version__,
    _after_fork_in_child,
    _at_exit,
    asarray,
    from_dlpack,
    reset_stats,
    runtime_info,
    set_export_release,
    stats,
    view,
)
from ._interpose import LibraryAdapter, order_libraries, register_library
from ._process_trace import serve_trace
from ._process_trace import start_from_environment as _start_tracing
from ._streams import Stream, as_stream, current_stream, stream
from ._trace import trace

# Threads still inside handoff's device calls must not take the GIL back while Python finalizes,
# and releases waiting for a consumer stream run producers' deleters: both while Python is alive.
_atexit.register(_at_exit)
# A forked child keeps none of the parent's threads: see handoff.runtime_info() there.
_os.register_at_fork(after_in_child=_after_fork_in_child)
_start_tracing()  # HANDOFF_TRACE, HANDOFF_ORDER, HANDOFF_TRACE_SOCKET: after _at_exit, whose handler must run last


def get_include() -> str:
    """The folder of the headers pybind11 extensions include: ``<handoff/pybind11.hpp>`` and the C
    table it calls, ``<handoff/python_c_api.h>`` (an installed handoff package)."""
    return str(_Path(__file__).with_name("include"))


def get_cmake_dir() -> str:
    """The folder where ``find_package(handoff)`` finds the target ``handoff::pybind11`` (pass it as
    ``handoff_DIR``); it links nothing of handoff's."""
    return str(_Path(__file__).parent / "share" / "cmake" / "handoff")


__all__ = [
    "Array",
    "DeviceError",
    "Exporter",
    "LibraryAdapter",
    "Stream",
    "__version__",
    "as_stream",
    "asarray",
    "current_stream",
    "from_dlpack",
    "get_cmake_dir",
    "get_include",
    "ipc",
    "order_libraries",
    "ownership_graph",
    "register_library",
    "reset_stats",
    "runtime_info",
    "serve_trace",
    "set_export_release",
    "stats",
    "stream",
    "trace",
    "view",
]
