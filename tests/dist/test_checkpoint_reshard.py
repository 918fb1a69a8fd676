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


def test_plain_tensor_on_two_ranks_is_saved_once(ranks, tmp_path):
    import fsg

    path = tmp_path / "c"
    assert ranks(2).run(workers.save_plain, str(path), False) == [None, None]
    meta = fsg.checkpoint.read_meta(path)
    (entry,) = [e for e in meta["leaves"] if e["path"] == "state['x']"]
    assert len(entry["pieces"]) == 1 and entry["pieces"][0]["file"] == "shard-00000.msgpack"
    restored = fsg.checkpoint.restore(path, like={"x": torch.zeros(2, 3), "n": 0})  # one process
    assert torch.equal(restored["x"], torch.arange(6.0).reshape(2, 3))


def test_plain_tensor_that_differs_between_ranks_is_refused(ranks, tmp_path):
    path = tmp_path / "c"
    errors = ranks(2).run(workers.save_plain, str(path), True)
    for message in errors:  # raised on every rank, naming the leaf and the rank
        assert "state['x']" in message and "ranks [1]" in message and "DTensor" in message
    assert not path.exists() and not path.with_name("c.tmp").exists()
