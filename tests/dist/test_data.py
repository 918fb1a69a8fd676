"""fsg.data on 2 gloo ranks: rank-local DTensor batches into the step, and resume on 1 rank."""

import torch

import fsg.checkpoint
import fsg.data
from tests.dist import data_workers


def test_rank_local_batches_equal_the_global_batch_and_resume_on_one_process(ranks, tmp_path):
    path = str(tmp_path / "ck")
    after = ranks(2).run(data_workers.check_rank_local_batches_match_the_global_batch, {"dp": 2}, path)
    assert all(torch.equal(a, b) for a, b in zip(after[0], after[1]))
    # resumed here, on one process (and on 4 simulated data ranks): the same next global batches
    for num_ranks in (1, 4):
        loaders = [
            fsg.data.Loader(data_workers.TOKENS, batch_size=data_workers.BATCH, seq_len=data_workers.SEQ, seed=0,
                            prefetch=0, rank=r, num_ranks=num_ranks)
            for r in range(num_ranks)
        ]  # fmt: skip
        for loader in loaders:
            loader.restore(fsg.checkpoint.restore(path, like=loader.state_dict(), select="state['data']"))
        resumed = [torch.cat([next(loader) for loader in loaders]) for _ in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(after[0], resumed))
