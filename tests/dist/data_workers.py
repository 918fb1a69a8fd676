"""Rank functions for tests/dist/test_data.py (spawn-importable)."""

import torch
from torch.distributed.tensor import DTensor

import fsg
import fsg.data
import fsg.testing

TOKENS = torch.arange(4000) % 61  # periodic text: the model can learn it
SEQ, BATCH = 8, 8


def _loss_fn(params, tokens_BT):
    x_BT, y_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
    logits_BTV = params["emb"][x_BT] @ params["out"]
    return fsg.nn.cross_entropy(logits_BTV, y_BT)


def _gathered(state):
    return {k: v.full_tensor() for k, v in state.params.items()}


def check_rank_local_batches_match_the_global_batch(axes: dict, path: str) -> list:
    """The step fed each rank's rows as a DTensor equals the step fed the global batch; the
    loader's state saved beside the train state. Returns the global batches after the save."""
    mesh = fsg.testing.mesh(axes)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    params = {"emb": torch.randn(61, 16), "out": torch.randn(16, 61) * 0.1}
    local_step = fsg.compile_step(_loss_fn, mesh, optimizer=fsg.optim.adamw(1e-2), backend="aot_eager")
    global_step = fsg.compile_step(_loss_fn, mesh, optimizer=fsg.optim.adamw(1e-2), backend="aot_eager")
    local_state, global_state = local_step.init(params), global_step.init(params)
    loader = fsg.data.Loader(TOKENS, batch_size=BATCH, seq_len=SEQ, seed=5, mesh=mesh, prefetch=2)
    reference = fsg.data.Loader(TOKENS, batch_size=BATCH, seq_len=SEQ, seed=5, prefetch=0)  # the global batch
    assert (loader.rank, loader.num_ranks) == (rank, 2)
    for _ in range(4):
        batch, global_batch = next(loader), next(reference)
        assert isinstance(batch, DTensor) and batch.shape == (BATCH, SEQ + 1)
        assert torch.equal(batch.to_local(), global_batch[rank * 4 : (rank + 1) * 4])  # only its rows
        local_state, m_local = local_step(local_state, batch)
        global_state, m_global = global_step(global_state, global_batch)
        torch.testing.assert_close(m_local["loss"], m_global["loss"], rtol=1e-5, atol=1e-6)
    for name, value in _gathered(local_state).items():
        torch.testing.assert_close(value, _gathered(global_state)[name], rtol=1e-5, atol=1e-6)
    fsg.checkpoint.save(path, {"train": local_state, "data": loader.state_dict()})
    after = [next(loader).full_tensor() for _ in range(3)]
    loader.close()
    return after
