"""A two-process hand-off on the simulated device: the producer's write is still held when the
consumer opens the array, and the consumer's stream waits for it on the device (the host of neither
process waits). Run it as `HANDOFF_BACKEND=sim python examples/two_processes.py`."""

from __future__ import annotations

import multiprocessing

import handoff
from handoff import ipc, sim


def consumer(handles, answers) -> None:
    stream = sim.Stream(non_blocking=True)
    array = ipc.open(handles.get(), stream=stream)  # maps the memory; `stream` waits for the producer
    pending = sim.to_numpy(array, stream=stream, wait=False)
    answers.put(f"opened; the read waits for the producer: done={pending.done()}")
    answers.put(f"read {pending.result()[:4]} ... (the producer's 42s, never the zeros before them)")


def main() -> None:
    context = multiprocessing.get_context("spawn")
    handles, answers = context.Queue(), context.Queue()
    other = context.Process(target=consumer, args=(handles, answers))
    other.start()
    stream = sim.Stream(non_blocking=True)
    data = sim.zeros(1 << 16, "float32")
    with sim.hold(stream):  # the producer's write waits, as a slow kernel would
        sim.fill(data, 42.0, stream=stream)
        handle = ipc.share(data)
        print(f"  producer (pid {handle.producer_pid}) shared {handle}")
        handles.put(handle)
        print("  consumer:", answers.get())
    print("  consumer:", answers.get())
    other.join()
    print(f"  producer stats: ipc_shares={handoff.stats()['ipc_shares']}")


if __name__ == "__main__":
    main()
