"""The loader: prefetching changes nothing, its state is what was consumed, and it checkpoints."""

import pytest
import torch

import fsg
import fsg.data


def make(prefetch: int, **kwargs) -> fsg.data.Loader:
    return fsg.data.Loader(torch.arange(3000), batch_size=8, seq_len=16, seed=7, prefetch=prefetch, **kwargs)


@pytest.mark.parametrize("prefetch", [1, 4])
def test_prefetching_yields_the_batches_of_the_caller_thread(prefetch):
    eager, ahead = make(0), make(prefetch)
    for _ in range(30):  # crosses epochs (187 windows)
        assert torch.equal(next(eager), next(ahead))
    ahead.close()


def test_state_is_the_position_consumed_not_the_position_prefetched():
    ahead, eager = make(4), make(0)
    for _ in range(3):
        next(ahead), next(eager)
    state = ahead.state_dict()  # the thread is batches ahead by now
    assert {k: int(v) for k, v in state.items()} == {"seed": 7, "epoch": 0, "position": 24, "num_windows": 187}
    expected = [next(eager) for _ in range(3)]
    ahead.restore(state)  # drops the prefetched batches, restarts at the saved position
    assert all(torch.equal(next(ahead), e) for e in expected)
    ahead.close()


def test_restore_carries_the_seed():
    a, b = make(0), fsg.data.Loader(torch.arange(3000), batch_size=8, seq_len=16, seed=99, prefetch=0)
    next(a)
    b.restore(a.state_dict())
    assert torch.equal(next(a), next(b)) and b.seed == 7


def test_batches_land_on_the_device_in_the_dtype_asked():
    batch = next(make(1, dtype=torch.int32, device="cpu"))
    assert batch.dtype == torch.int32 and batch.shape == (8, 17) and batch.is_contiguous()


def test_the_loader_state_checkpoints_beside_the_train_state(tmp_path):
    loader = make(2)
    for _ in range(5):
        next(loader)
    state = {"train": {"w": torch.ones(3)}, "data": loader.state_dict()}
    fsg.checkpoint.save(tmp_path / "ck", state)
    expected = next(loader)
    loader.close()
    # restored onto two data ranks: their rows make the same next global batch
    ranks = [make(0, rank=r, num_ranks=2) for r in range(2)]
    for r in ranks:
        restored = fsg.checkpoint.restore(tmp_path / "ck", like=r.state_dict(), select="state['data']")
        r.restore(restored)
    assert torch.equal(torch.cat([next(r) for r in ranks]), expected)


def test_close_and_reopen_continues():
    ahead, eager = make(3), make(0)
    next(ahead), next(eager)
    ahead.close()
    assert torch.equal(next(ahead), next(eager))
    ahead.close()


def test_a_loader_feeds_compile_step_with_the_shift_in_the_loss():
    torch.manual_seed(0)
    params = {"emb": torch.randn(64, 8), "out": torch.randn(8, 64)}

    def loss_fn(params, tokens_BT):
        x_BT, y_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
        logits_BTV = params["emb"][x_BT] @ params["out"]
        return fsg.nn.cross_entropy(logits_BTV, y_BT)

    step = fsg.compile_step(loss_fn, optimizer=fsg.optim.sgd(0.5), backend="aot_eager")
    state = step.init(params)
    loader = fsg.data.Loader(torch.arange(2000) % 64, batch_size=8, seq_len=16, prefetch=2)
    losses = []
    for _ in range(20):
        state, metrics = step(state, next(loader))
        losses.append(float(metrics["loss"]))
    loader.close()
    assert losses[-1] < losses[0] - 1.0
