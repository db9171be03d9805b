# Type information for the native extension handoff._handoff (python/src). The stubs form a package
# so that its submodule _sim has one too; at run time the extension module is imported, since a
# directory without __init__.py never takes precedence over an extension module beside it.

from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, ClassVar, Literal, NoReturn, Protocol, SupportsIndex, TypedDict, final, type_check_only

from typing_extensions import Buffer, CapsuleType, TypeAlias

from handoff._streams import Stream

from . import _ipc as _ipc
from . import _sim as _sim

__version__: str

# --- what the functions accept ---------------------------------------------------------------

# A DLPack device: (device_type, device_id) with DLPack's codes (1: CPU, 2: CUDA, 10: ROCm, ...).
_DLDevice: TypeAlias = tuple[int, int]
# A device argument: a DLPack device or 'cpu'.
_DeviceArgument: TypeAlias = _DLDevice | Literal["cpu"]

@type_check_only
class _SupportsDLPack(Protocol):
    # DLPack's arguments are optional keywords, which some producers' stubs leave out (JAX's).
    def __dlpack__(self) -> object: ...

@type_check_only
class _SupportsCudaArrayInterface(Protocol):
    @property
    def __cuda_array_interface__(self) -> Mapping[str, Any]: ...

@type_check_only
class _SupportsArrayInterface(Protocol):
    @property
    def __array_interface__(self) -> Mapping[str, Any]: ...

@type_check_only
class _SupportsCudaStream(Protocol):
    def __cuda_stream__(self) -> tuple[int, int]: ...

@type_check_only
class _HasCudaStream(Protocol):  # PyTorch's streams
    @property
    def cuda_stream(self) -> int: ...

@type_check_only
class _HasPtr(Protocol):  # CuPy's streams
    @property
    def ptr(self) -> int: ...

# A stream, as handoff.as_stream accepts it: an int (a DLPack stream value), a handoff.Stream, or an
# object with __cuda_stream__(), .cuda_stream or .ptr.
_StreamLike: TypeAlias = int | Stream | _SupportsCudaStream | _HasCudaStream | _HasPtr

# What asarray imports.
_ArrayLike: TypeAlias = _SupportsDLPack | CapsuleType | _SupportsCudaArrayInterface | _SupportsArrayInterface | Buffer

# A dtype for view(): a name such as 'float32', or an object naming one in `name` (a NumPy dtype).
@type_check_only
class _HasDTypeName(Protocol):
    @property
    def name(self) -> str: ...

# --- what they return ------------------------------------------------------------------------

@type_check_only
class _Stats(TypedDict):
    exports: int
    imports: int
    waits_inserted: int
    waits_elided: int
    events_created: int
    events_reused: int
    deferred_releases: int
    live_views: int
    pending_releases: int
    ipc_shares: int
    ipc_opens: int
    ipc_mappings_cached: int
    ipc_pending_remote_releases: int

# The backends HANDOFF_BACKEND chooses from ('auto' reports the one it started); a name handoff does
# not know is reported as given, with backend_error saying so.
_BackendName: TypeAlias = Literal["cuda", "sim", "sim-rocm", "none"]

@type_check_only
class _RuntimeInfo(TypedDict):
    backend: _BackendName | str
    device_count: int
    version: str
    dlpack_version: str
    cuda_compiled: bool
    cuda_runtime: str | None
    cuda_driver_minimum: int | None
    backend_error: str | None

# Which consumer streams an export's release waits for (set_export_release).
_ExportRelease: TypeAlias = Literal["known-streams", "every-stream"]

_StreamOrder: TypeAlias = Literal["none", "legacy_default", "per_thread_default", "default_stream", "handle"]

# --- the extension ---------------------------------------------------------------------------

class DeviceError(RuntimeError):
    backend: str
    error_name: str

@final
class Array:
    # The C exchange API table (a "dlpack_exchange_api" capsule).
    __dlpack_c_exchange_api__: ClassVar[CapsuleType]
    __c_dlpack_exchange_api__: ClassVar[int]
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> _DLDevice: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def readonly(self) -> bool: ...
    @property
    def ndim(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def __dlpack__(
        self,
        /,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: _DeviceArgument | None = None,
        copy: bool | None = None,
    ) -> CapsuleType: ...
    def __dlpack_device__(self, /) -> _DLDevice: ...
    def __reduce_ex__(self, protocol: SupportsIndex, /) -> NoReturn: ...

def from_dlpack(
    x: _SupportsDLPack | CapsuleType,
    /,
    *,
    device: _DeviceArgument | None = None,
    copy: bool | None = None,
    stream: _StreamLike | None = None,
) -> Array: ...
def asarray(
    x: _ArrayLike,
    /,
    *,
    device: _DeviceArgument | None = None,
    copy: bool | None = None,
    stream: _StreamLike | None = None,
) -> Array: ...
def view(
    data_ptr: int,
    shape: int | Sequence[int],
    dtype: str | _HasDTypeName,
    *,
    device: _DeviceArgument,
    strides: int | Sequence[int] | None = None,
    owner: object = None,
    stream: _StreamLike | None = None,
    readonly: bool = False,
) -> Array: ...
def stats() -> _Stats: ...
def reset_stats() -> None: ...
def runtime_info() -> _RuntimeInfo: ...
def set_export_release(policy: _ExportRelease) -> _ExportRelease: ...

# --- for the handoff package -----------------------------------------------------------------

_stream_var: ContextVar[tuple[Any, ...]]  # the open handoff.stream blocks, innermost last
# The C functions extensions call (<handoff/python_c_api.h>, through <handoff/pybind11.hpp>).
_C_API: CapsuleType

def _set_stream_type(stream_type: type[Stream]) -> None: ...
def _resolve_stream(stream: object) -> tuple[int, int | None]: ...
def _check_stream(handle: object, device: object) -> None: ...
def _at_exit() -> None: ...
def _after_fork_in_child() -> None: ...
def _log_warning(message: str) -> None: ...
def _trace_begin(limit: int = 0, activity: bool = False) -> int: ...
def _watch_activity(watch: bool) -> str | None: ...
def _trace_dropped(token: int) -> int: ...
def _trace_events(token: int) -> list[dict[str, Any]]: ...
def _trace_end(token: int) -> list[dict[str, Any]]: ...
def _ownership_graph() -> dict[str, Any]: ...
def _trace_held(token: int) -> list[dict[str, Any]]: ...

@type_check_only
class _PybindEnum:  # what pybind11's enums have
    __members__: ClassVar[dict[str, Any]]
    def __init__(self, value: int) -> None: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

@final
class _InterposedProtocol(_PybindEnum):
    dlpack: ClassVar[_InterposedProtocol]
    cuda_array_interface: ClassVar[_InterposedProtocol]

@final
class _InterposedHazard(_PybindEnum):
    none: ClassVar[_InterposedHazard]
    unordered: ClassVar[_InterposedHazard]
    cross_device: ClassVar[_InterposedHazard]
    released_early: ClassVar[_InterposedHazard]

@final
class _TraceKind(_PybindEnum):
    import_data: ClassVar[_TraceKind]
    release: ClassVar[_TraceKind]

@final
class _TraceAction(_PybindEnum):
    none: ClassVar[_TraceAction]
    wait: ClassVar[_TraceAction]
    elided: ClassVar[_TraceAction]
    unordered: ClassVar[_TraceAction]
    refused: ClassVar[_TraceAction]

@final
class _InterposedExchange:
    stream_argument: int | None
    ordered: bool
    def __init__(
        self, protocol: _InterposedProtocol, producer: str, consumer: str, device: tuple[int, int]
    ) -> None: ...
    @property
    def work_device(self) -> int | None: ...
    @property
    def protocol(self) -> _InterposedProtocol: ...
    @property
    def producer(self) -> str: ...
    @property
    def consumer(self) -> str: ...
    @property
    def producer_stream(self) -> int | None: ...
    @property
    def consumer_stream(self) -> int | None: ...
    @property
    def knows_streams(self) -> bool: ...
    @property
    def consumer_stream_outlives_releases(self) -> bool: ...
    def set_producer_stream(self, stream: object) -> None: ...
    def set_consumer_stream(self, stream: object) -> None: ...
    def order(self) -> bool: ...
    def consumer_stream_busy(self) -> bool: ...
    def record(self, kind: _TraceKind, action: _TraceAction, hazard: _InterposedHazard, detail: str) -> None: ...
    def record_import(
        self, argument: object, result: object, action: _TraceAction, hazard: _InterposedHazard, detail: str
    ) -> None: ...
    def record_refusal(self, error: BaseException) -> None: ...

def _interposed_stream_device(handle: int) -> int | None: ...
def _interposed_call(
    original: Callable[..., Any],
    consumer: Any,
    find_library: Callable[[type], tuple[str | None, Any]],
    exchange: Callable[..., Any],
    not_recorded: Callable[[Exception], None],
) -> Callable[..., Any]: ...
def _interposed_forget_libraries() -> None: ...
def _interposed_set_mode(tracing: bool, ordering: bool) -> None: ...
def _interposed_begin(argument: object, device: tuple[int, int]) -> None: ...
def _interposed_end() -> tuple[int | None, int | None]: ...
def _interposed_producer_hook(original: Callable[..., Any]) -> Callable[..., Any]: ...
def _set_stream_owner_lookup(lookup: Callable[[int, int], object]) -> None: ...
def _set_library_of_file(classify: Callable[[str], str | None]) -> None: ...
def _serve_trace() -> str: ...
def _stop_serving_trace() -> None: ...
def _trace_socket_paths(pid: int) -> list[str]: ...
def _device_type_labels() -> dict[int, str]: ...
def _classify_stream(device_type: int, stream: int | None) -> tuple[_StreamOrder, int]: ...
def _parse_cuda_array_interface(interface: object) -> tuple[tuple[int, ...], int | None]: ...
def _exporter_dlpack(
    instance: object,
    exported: Array,
    stream: int | None,
    max_version: tuple[int, int] | None,
    dl_device: _DeviceArgument | None,
    copy: bool | None,
) -> CapsuleType: ...
