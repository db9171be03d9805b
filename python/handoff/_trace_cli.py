"""handoff-trace: inspect handoff's exchanges. For now it reports the version and the runtime."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="handoff-trace",
        description="Show handoff's runtime: backend, devices, versions (exchange tracing is coming).",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--json", action="store_true", help="print the runtime information as JSON")
    args = parser.parse_args(argv)

    import handoff

    if args.version:
        print(f"handoff-trace {handoff.__version__}")
        return 0
    info = handoff.runtime_info()
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
        return 0
    print(f"handoff {handoff.__version__} (DLPack {info['dlpack_version']})")
    for key in ("backend", "device_count", "cuda_compiled", "cuda_runtime", "cuda_driver_minimum", "backend_error"):
        print(f"  {key:>19}: {info[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
