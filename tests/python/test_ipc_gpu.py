"""handoff.ipc on a GPU: two processes on one GPU, PyTorch making the producer's work slow
(torch.cuda._sleep), each test with its negative control. Skips without a usable CUDA device."""

from __future__ import annotations

import pytest

from support import cuda_is_usable

pytestmark = pytest.mark.skipif(not cuda_is_usable(), reason="needs a CUDA device and driver (HANDOFF_BACKEND=cuda)")

SLOW = 2_000_000_000  # cycles of torch.cuda._sleep: about a second on any GPU of today


def _agent(**env):
    from test_ipc import Agent

    return Agent(HANDOFF_BACKEND="cuda", **env)


@pytest.mark.parametrize("ordered", [True, pytest.param(False, marks=pytest.mark.negative_control)])
@pytest.mark.parametrize("sync", ["event", "value"])
def test_the_consumer_waits_for_the_producer_kernel(ordered, sync):
    producer, consumer = _agent(HANDOFF_IPC_SYNC=sync), _agent()
    try:
        # The consumer's CUDA context and kernels are made before the producer's second of spin
        # starts: made after, they could take longer than the spin and hide the negative control's race.
        consumer.run("import torch; torch.zeros(1 << 20, device='cuda').clone().min(); torch.cuda.synchronize()")
        data = producer.run(
            "import torch; s = torch.cuda.Stream(); x = torch.zeros(1 << 20, device='cuda')\n"
            f"with torch.cuda.stream(s): torch.cuda._sleep({SLOW}); x.fill_(7.0)\n"
            "h = ipc.share(handoff.from_dlpack(x, stream=s.cuda_stream)); result = list(bytes(h))"
        )
        seen = consumer.run(
            "import torch; c = torch.cuda.Stream()\n"
            f"a = ipc.open(ipc.Handle({bytes(data)!r}), stream=c.cuda_stream)\n"
            # Read on `c`, which the open ordered, or unordered (stream=-1) on a stream of its own:
            # naming that stream to `a.__dlpack__` would order it after `c` too.
            f"read_on = c if {ordered} else torch.cuda.Stream()\n"
            f"with torch.cuda.stream(read_on): t = torch.from_dlpack(a if {ordered} else a.__dlpack__(stream=-1)).clone()\n"
            "read_on.synchronize(); result = float(t.min())"
        )
        assert (seen == 7.0) is ordered
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("back_signal", [True, pytest.param(False, marks=pytest.mark.negative_control)])
def test_the_producer_keeps_its_memory_until_the_consumer_kernel_is_done(back_signal):
    producer, consumer = _agent(), _agent()
    try:
        data = producer.run(
            "import torch; x = torch.ones(1 << 20, device='cuda'); h = ipc.share(handoff.from_dlpack(x))\n"
            "del x; result = list(bytes(h))"
        )
        consumer.run(
            "import torch; from handoff import _handoff\n"
            f"_handoff._ipc._set_back_signal({back_signal}); c = torch.cuda.Stream()\n"
            f"a = ipc.open(ipc.Handle({bytes(data)!r}), stream=c.cuda_stream)\n"
            # Handed over unordered (stream=-1), so that the export's own release does not wait for
            # `c`: what keeps the producer's memory is the opened view's release alone.
            f"with torch.cuda.stream(c): torch.cuda._sleep({SLOW}); t = torch.from_dlpack(a.__dlpack__(stream=-1)) * 2\n"
            "del a"
        )
        released = producer.run(
            "del h; ipc._poll(); ipc._poll(); result = handoff.stats()['ipc_pending_remote_releases'] == 0"
        )
        assert released is (not back_signal)
        consumer.run("torch.cuda.synchronize()")
    finally:
        producer.close()
        consumer.close()
