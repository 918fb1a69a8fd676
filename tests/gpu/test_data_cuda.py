"""fsg.data.Loader on CUDA (skipped without a GPU): the batches every worker count copies to the
device through pinned memory and side streams are the CPU loader's, ready for the consumer's
stream (also a non-default one) without a host sync, and a resume onto another worker count
continues them."""

import pytest
import torch

import fsg.data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOKENS = torch.arange(200_001) % 50257


def make(**kwargs) -> fsg.data.Loader:
    return fsg.data.Loader(TOKENS, batch_size=16, seq_len=1024, seed=5, **kwargs)


def cpu_batches(n: int) -> list[torch.Tensor]:
    reference = make(prefetch=0, device="cpu")
    return [next(reference) for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 1, 2, 4])
def test_every_worker_count_delivers_the_cpu_batches_on_the_device(workers):
    expected = cpu_batches(30)  # 195 windows: crosses an epoch
    with make(prefetch=max(workers, 2), workers=workers, device="cuda") as loader:
        got = []
        for _ in range(30):
            batch = next(loader)
            assert batch.device.type == "cuda"
            got.append((batch * 1).sum(dim=1))  # used on the current stream at once: no sync in between
            del batch  # its memory is reused only after the consumer's stream is done with it
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), e.sum(dim=1)) for g, e in zip(got, expected))


def test_batches_are_ready_for_a_non_default_consumer_stream():
    expected = cpu_batches(10)
    side = torch.cuda.Stream()
    with make(prefetch=4, workers=2, device="cuda") as loader, torch.cuda.stream(side):
        sums = [next(loader).sum(dim=1) for _ in range(10)]
    side.synchronize()
    assert all(torch.equal(s.cpu(), e.sum(dim=1)) for s, e in zip(sums, expected))


def test_a_resume_onto_another_worker_count_continues_on_the_device():
    expected = cpu_batches(12)
    with make(prefetch=4, workers=4, device="cuda") as loader:
        for _ in range(5):
            next(loader)
        state = loader.state_dict()
    with make(prefetch=2, workers=1, device="cuda") as restored:
        restored.restore(state)
        got = [next(restored).cpu() for _ in range(7)]
    assert all(torch.equal(g, e) for g, e in zip(got, expected[5:]))
