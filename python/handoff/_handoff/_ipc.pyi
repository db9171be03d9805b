# Type information for handoff._handoff._ipc, the hand-off across processes (handoff.ipc wraps it).

from typing import Any, TypedDict

from . import Array

class _Hold: ...

class _Description(TypedDict):
    producer_pid: int
    device: tuple[int, int]
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    backend: str
    host_memory: bool
    in_flight: bool

def share(x: Any, stream: Any, copy: bool | None, in_flight: bool) -> tuple[bytes, _Hold | None]: ...
def open(handle: bytes, stream: Any) -> Array: ...
def describe(handle: bytes) -> _Description: ...
def _set_back_signal(on: bool) -> bool: ...
def _poll() -> None: ...
def _shutdown() -> None: ...
