"""A checkpoint written on one mesh restores bit-exact onto another (gloo ranks)."""

import torch

from tests.dist import workers


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_four_ranks_fsdp_to_two_ranks_fsdp(ranks, tmp_path):
    path = str(tmp_path / "c")
    saved = ranks(4).run(workers.save_trained, path, {"dp": 4}, "fsdp")[0]
    results = ranks(2).run(workers.restore_onto, path, {"dp": 2}, "fsdp")
    for restored, _ in results:
        assert_same(saved, restored)
    # each rank reads the pieces overlapping its half, not the whole checkpoint
    total = sum(t.numel() * t.element_size() for t in saved.values())
    for _, nbytes in results:
        assert nbytes < 0.7 * total


def test_tensor_parallel_to_replicated(ranks, tmp_path):
    path = str(tmp_path / "c")
    saved = ranks(2).run(workers.save_trained, path, {"tp": 2}, "tp")[0]
    for restored, _ in ranks(2).run(workers.restore_onto, path, {"dp": 2}, "dp"):
        assert_same(saved, restored)


def test_single_process_to_two_ranks(ranks, tmp_path):
    path = str(tmp_path / "c")
    saved = workers.save_trained(path, None, "fsdp")
    for restored, _ in ranks(2).run(workers.restore_onto, path, {"dp": 2}, "fsdp"):
        assert_same(saved, restored)


def test_sharded_to_single_process(ranks, tmp_path):
    path = str(tmp_path / "c")
    saved = ranks(2).run(workers.save_trained, path, {"dp": 2}, "fsdp")[0]
    restored, _ = workers.restore_onto(path, None, "fsdp")
    assert_same(saved, restored)
