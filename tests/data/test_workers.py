"""fsg.data.Loader(workers=N): background threads build different future batches at once, and
nothing else changes: the batches, their order, the state and a resume are workers=0's; a
worker's error is raised in the consumer at its batch; close() joins every worker."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsg
import fsg.data
from tests.data.strategies import LoaderCase, loader_case_strategy


def make(case: LoaderCase, *, workers: int, prefetch: int, **kwargs) -> fsg.data.Loader:
    return fsg.data.Loader(
        torch.arange(case.num_tokens), batch_size=case.batch_size, seq_len=case.seq_len, seed=case.seed,
        workers=workers, prefetch=prefetch, **kwargs,
    )  # fmt: skip


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fsg-data-worker")]


@st.composite
def feeding_strategy(draw) -> tuple[int, int]:
    """``(workers, prefetch)``: 0 to 4 workers and a depth of at least that many batches."""
    workers = draw(st.integers(0, 4))
    return workers, workers + draw(st.integers(0, 3))


@given(
    case=loader_case_strategy(max_tokens=300), feeding=feeding_strategy(), resumed=feeding_strategy(),
    steps=st.integers(1, 12), stop=st.integers(0, 12), num_ranks=st.sampled_from([1, 2, 4]), data=st.data(),
)  # fmt: skip
def test_any_worker_count_yields_the_batches_of_workers_0_and_resumes_onto_any_other(
    case, feeding, resumed, steps, stop, num_ranks, data
):
    rank = data.draw(st.integers(0, num_ranks - 1))
    stop = min(stop, steps)
    reference = make(case, workers=0, prefetch=0, rank=rank, num_ranks=num_ranks)
    expected = [next(reference) for _ in range(steps)]

    (workers, prefetch), (workers2, prefetch2) = feeding, resumed
    with make(case, workers=workers, prefetch=prefetch, rank=rank, num_ranks=num_ranks) as loader:
        got = [next(loader) for _ in range(stop)]
        state = loader.state_dict()  # the workers are batches ahead by now
        got += [next(loader) for _ in range(steps - stop)]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))

    # the state saved at `stop`, restored onto another worker count and depth
    with make(case, workers=workers2, prefetch=prefetch2, rank=rank, num_ranks=num_ranks) as restored:
        restored.restore(state)
        again = [next(restored) for _ in range(steps - stop)]
    assert all(torch.equal(g, e) for g, e in zip(again, expected[stop:], strict=True))


def test_a_restore_onto_a_running_loader_drops_what_its_workers_built():
    case = LoaderCase(num_tokens=4001, seq_len=16, batch_size=8, seed=3)
    reference = make(case, workers=0, prefetch=0)
    expected = [next(reference) for _ in range(20)]
    with make(case, workers=3, prefetch=5) as loader:
        for _ in range(12):
            next(loader)
        earlier = make(case, workers=0, prefetch=0)
        for _ in range(4):
            next(earlier)
        loader.restore(earlier.state_dict())  # back 8 batches, while 5 later ones are built
        assert all(torch.equal(next(loader), e) for e in expected[4:20])


class _FailingTokens(fsg.data.Tokens):
    """Tokens whose read of window start ``bad`` raises ``OSError`` (as a failing disk would)."""

    def __init__(self, tokens, bad: int, delay_s: float = 0.0):
        super().__init__(tokens, name="flaky.bin")
        self.bad, self.delay_s = bad, delay_s

    def rows(self, starts, length, out=None):
        time.sleep(self.delay_s)
        if self.bad in starts.tolist():
            raise OSError(f"read error at token {self.bad}")
        return super().rows(starts, length, out)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_worker_error_is_raised_in_the_consumer_at_its_batch(workers):
    tokens = torch.arange(2001)  # 125 windows of 17 tokens
    reference = fsg.data.Loader(tokens, batch_size=5, seq_len=16, seed=1, prefetch=0)
    batches = [next(reference) for _ in range(6)]
    bad = int(batches[4][2, 0])  # a window of the fifth batch (stream positions 20..24)

    loader = fsg.data.Loader(_FailingTokens(tokens, bad), batch_size=5, seq_len=16, seed=1,
                             prefetch=4, workers=workers)  # fmt: skip
    assert all(torch.equal(next(loader), b) for b in batches[:4])  # the batches before it, in order
    with pytest.raises(OSError, match=f"read error at token {bad}") as raised:
        next(loader)
    notes = getattr(raised.value, "__notes__", [])
    assert any(
        "background worker" in n and f"of {workers}" in n and "the batch at epoch 0, position 20" in n for n in notes
    ), notes
    assert not worker_threads()  # the failure stopped every worker
    assert int(loader.state_dict()["position"]) == 20  # the state is at the failed batch
    with pytest.raises(OSError):  # and the next call tries that batch again
        next(loader)
    loader.close()


def test_a_token_id_beyond_the_vocabulary_is_the_same_error_from_any_worker_count(tmp_path):
    path = fsg.data.write_tokens(tmp_path / "t.bin", [1] * 50 + [300] + [1] * 49)
    messages = []
    for workers in (0, 1, 2):
        loader = fsg.data.Loader(path, batch_size=3, seq_len=9, vocab_size=256, prefetch=2, workers=workers)
        with loader, pytest.raises(fsg.data.DataError) as raised:
            for _ in range(10):
                next(loader)
        messages.append(str(raised.value))
    assert messages[0] == messages[1] == messages[2] and "token id 300 at token 50" in messages[0]


def test_close_joins_every_worker_promptly():
    case = LoaderCase(num_tokens=4001, seq_len=16, batch_size=8, seed=0)
    loader = make(case, workers=4, prefetch=6)
    next(loader)
    assert len(worker_threads()) == 4
    t0 = time.perf_counter()
    loader.close()  # the workers wait for room to build more: they wake and leave
    assert not worker_threads() and time.perf_counter() - t0 < 1.0
    next(loader)  # reopens where it stands
    assert len(worker_threads()) == 4
    del loader
    gc.collect()  # a loader dropped without close() stops its workers too
    assert not worker_threads()


def test_close_waits_for_at_most_the_batch_a_worker_is_building():
    slow = _FailingTokens(torch.arange(4001), bad=-1, delay_s=0.3)  # each batch takes 0.3 s
    loader = fsg.data.Loader(slow, batch_size=8, seq_len=16, prefetch=3, workers=3)
    next(loader)  # the three workers are now each building a batch
    t0 = time.perf_counter()
    loader.close()
    assert not worker_threads() and time.perf_counter() - t0 < 0.3 + 0.5


def test_workers_build_batches_at_the_same_time():
    busy = {"now": 0, "most": 0}
    lock = threading.Lock()

    class Slow(fsg.data.Tokens):
        def rows(self, starts, length, out=None):
            with lock:
                busy["now"] += 1
                busy["most"] = max(busy["most"], busy["now"])
            time.sleep(0.05)  # an I/O wait: releases the GIL, as a page fault of a memory map does
            with lock:
                busy["now"] -= 1
            return super().rows(starts, length, out)

    with fsg.data.Loader(Slow(torch.arange(4001)), batch_size=8, seq_len=16, prefetch=4, workers=4) as loader:
        t0 = time.perf_counter()
        for _ in range(12):
            next(loader)
        elapsed = time.perf_counter() - t0
    assert busy["most"] >= 2 and elapsed < 12 * 0.05, (busy, elapsed)


def test_workers_and_prefetch_are_checked():
    tokens = torch.arange(1000)
    with pytest.raises(
        fsg.ArgumentError, match=r"workers=...\) must be at most prefetch=2 .* got int 3. raise prefetch to 3"
    ):
        fsg.data.Loader(tokens, batch_size=4, seq_len=16, workers=3, prefetch=2)
    with pytest.raises(fsg.ArgumentError, match=r"workers=...\) must be an int >= 0; got int -1"):
        fsg.data.Loader(tokens, batch_size=4, seq_len=16, workers=-1)
    assert fsg.data.Loader(tokens, batch_size=4, seq_len=16).workers == 1  # the default: one thread
    assert fsg.data.Loader(tokens, batch_size=4, seq_len=16, prefetch=0).workers == 0


def test_gathered_rows_equal_slices_of_the_file(tmp_path):
    ids = np.random.default_rng(0).integers(0, 60000, size=5000)
    for fmt in ("nanogpt", "llmc"):
        src = fsg.data.TokenFile(fsg.data.write_tokens(tmp_path / f"{fmt}.bin", ids, format=fmt))
        starts = np.array([0, 4999 - 33, 17, 17, 2500])
        expected = np.stack([ids[s : s + 33] for s in starts])
        assert np.array_equal(src.rows(starts, 33).numpy(), expected)
        out = torch.empty((5, 33), dtype=torch.int64)
        assert src.rows(starts, 33, out=out) is out and np.array_equal(out.numpy(), expected)
