"""A process the IPC tests drive from theirs: it runs the Python statements each line of its
standard input holds (JSON-encoded), in one namespace, and answers each with one JSON line on its
standard output: {"ok": repr of `result`} or {"error": type name, "message": text}. Waiting for an
answer is how a test knows that the other process got somewhere (a pipe, never a sleep)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    namespace: dict[str, object] = {"__name__": "ipc_agent"}
    exec("import handoff, numpy\nfrom handoff import ipc", namespace)
    print(json.dumps({"ok": "ready"}), flush=True)
    for line in sys.stdin:
        namespace["result"] = None
        try:
            exec(json.loads(line), namespace)
            answer = {"ok": namespace["result"]}
            json.dumps(answer)
        except BaseException as e:  # noqa: BLE001 - every failure is the test's to read
            answer = {"error": type(e).__name__, "message": str(e)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
