"""Per-import and per-export host cost of handoff next to NumPy's and PyTorch's own, in one process.

Each row times one exchange (a DLPack capsule made by the producer and consumed by the consumer),
best of several repeats (handoff's and the peer's interleaved, so that both see the same machine
load), and prints the ratio to the peer doing the same job. Ownership tracking
(live_views, stats) is always on in handoff.

    .venv/bin/python bench/exchange_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import platform
import timeit

import numpy as np
import torch

import handoff


def best_ns_pair(ours, peer, number: int, repeat: int) -> tuple[float, float]:
    """Best time per call of each, the repeats interleaved so that both see the same machine load."""
    gc.collect()
    best_ours = best_peer = float("inf")
    for _ in range(repeat):
        best_ours = min(best_ours, timeit.timeit(ours, number=number))
        best_peer = min(best_peer, timeit.timeit(peer, number=number))
    return best_ours / number * 1e9, best_peer / number * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = parser.parse_args()
    number, repeat = (2_000, 3) if args.quick else (50_000, 7)

    np_array = np.ones((64, 64), dtype=np.float32)
    torch_tensor = torch.ones((64, 64), dtype=torch.float32)
    view = handoff.from_dlpack(np_array)

    rows = [
        # (what, handoff's call, peer's name, peer's call)
        (
            "import NumPy array",
            lambda: handoff.from_dlpack(np_array),
            "np.from_dlpack",
            lambda: np.from_dlpack(np_array),
        ),
        (
            "import NumPy array",
            lambda: handoff.from_dlpack(np_array),
            "torch.from_dlpack",
            lambda: torch.from_dlpack(np_array),
        ),
        (
            "import torch tensor",
            lambda: handoff.from_dlpack(torch_tensor),
            "torch.from_dlpack",
            lambda: torch.from_dlpack(torch_tensor),
        ),
        (
            "import torch tensor",
            lambda: handoff.from_dlpack(torch_tensor),
            "np.from_dlpack",
            lambda: np.from_dlpack(torch_tensor),
        ),
        # PyTorch's tensors are imported through its DLPack C exchange API; the goal is NumPy's own
        # import of its own array, and the second row is what calling torch's __dlpack__ costs.
        (
            "import torch tensor",
            lambda: handoff.from_dlpack(torch_tensor),
            "np.from_dlpack(ndarray)",
            lambda: np.from_dlpack(np_array),
        ),
        (
            "import torch tensor",
            lambda: handoff.from_dlpack(torch_tensor),
            "handoff, via __dlpack__",
            lambda: handoff.from_dlpack(torch_tensor.__dlpack__(max_version=(1, 1))),
        ),
        ("export to NumPy", lambda: np.from_dlpack(view), "NumPy array", lambda: np.from_dlpack(np_array)),
        ("export to torch", lambda: torch.from_dlpack(view), "NumPy array", lambda: torch.from_dlpack(np_array)),
        (
            "__dlpack__() alone",
            lambda: view.__dlpack__(max_version=(1, 1)),
            "ndarray.__dlpack__",
            lambda: np_array.__dlpack__(max_version=(1, 1)),
        ),
        (
            "asarray(NumPy array)",
            lambda: handoff.asarray(np_array),
            "np.asarray(memoryview)",
            lambda: np.asarray(memoryview(np_array)),
        ),
    ]

    print(
        f"handoff {handoff.__version__} | NumPy {np.__version__} | PyTorch {torch.__version__} | "
        f"Python {platform.python_version()} | {platform.machine()}"
    )
    print(f"best of {repeat} x {number} calls, ns per call; ratio = handoff / peer (<= 1.0: handoff is no slower)\n")
    print(f"| {'exchange':<22} | {'handoff ns':>10} | {'peer':<23} | {'peer ns':>8} | {'ratio':>5} |")
    print(f"|{'-' * 24}|{'-' * 12}:|{'-' * 25}|{'-' * 9}:|{'-' * 6}:|")
    for what, ours, peer_name, peer in rows:
        ours_ns, peer_ns = best_ns_pair(ours, peer, number, repeat)
        print(f"| {what:<22} | {ours_ns:>10.0f} | {peer_name:<23} | {peer_ns:>8.0f} | {ours_ns / peer_ns:>5.2f} |")
    print(f"\nlive_views after the run: {handoff.stats()['live_views']} (the one view held by this script)")


if __name__ == "__main__":
    main()
