"""handoff.ownership_graph: who holds which buffer, on which streams, now."""

from __future__ import annotations

import json
from typing import Any, Literal, overload

from . import _handoff
from ._trace import graph_to_dot


@overload
def ownership_graph(format: Literal["dict"] = "dict") -> dict[str, Any]: ...
@overload
def ownership_graph(format: Literal["json", "dot"]) -> str: ...
def ownership_graph(format: str = "dict") -> dict[str, Any] | str:
    """A snapshot of the ownership graph: the buffers alive (with their library, device, shape, dtype
    and size), the views that hold them and the streams they are ready on and released after.

    Args:
        format: ``"dict"`` (``{"nodes": [...], "edges": [...]}``), ``"json"`` (the same as JSON text)
            or ``"dot"`` (Graphviz).
    """
    graph = _handoff._ownership_graph()
    if format == "dict":
        return graph
    if format == "json":
        return json.dumps(graph)
    if format == "dot":
        return graph_to_dot(graph)
    raise ValueError(f"ownership_graph: format must be 'dict', 'json' or 'dot', not {format!r}")
