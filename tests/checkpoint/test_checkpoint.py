"""fsg.checkpoint on one process: round trips, errors, partial restore, safetensors."""

import os
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsg
from fsg._src import tree
from tests.helpers import mlp, mse_loss_fn, regression_batch

DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip


class Pair(NamedTuple):
    a: object
    b: object


@st.composite
def tensor_strategy(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()),),
                        generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)  # fmt: skip
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return raw[:n].view(dtype).reshape(shape)  # any bit pattern: NaNs, -0.0, subnormals


leaf_strategy = st.one_of(tensor_strategy(), st.integers(-5, 5), st.floats(allow_nan=False), st.booleans(), st.none())
tree_strategy = st.recursive(
    leaf_strategy,
    lambda children: st.one_of(
        st.dictionaries(st.text("abcxyz_.", min_size=1, max_size=4), children, max_size=3),
        st.lists(children, max_size=3),
        st.builds(Pair, children, children),
    ),
    max_leaves=8,
)


def same_bits(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )  # fmt: skip
    return a == b and type(a) is type(b)


@given(tree_strategy)
def test_round_trip_is_bit_exact(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("ckpt") / "c"
    fsg.checkpoint.save(path, state, metadata={"note": "hypothesis"})
    restored = fsg.checkpoint.restore(path, like=state)
    a, treedef_a = tree.flatten(state)
    b, treedef_b = tree.flatten(restored)
    assert treedef_a == treedef_b
    assert all(same_bits(x, y) for x, y in zip(a, b))
    assert fsg.checkpoint.read_meta(path)["metadata"] == {"note": "hypothesis"}


def trained_state(steps=2):
    model = mlp()
    step = fsg.compile_step(mse_loss_fn(model), optimizer=fsg.optim.adamw(1e-2), backend="aot_eager")
    state = step.init(fsg.params(model))
    for i in range(steps):
        state, _ = step(state, regression_batch(seed=i))
    return step, state


def test_train_state_round_trip_and_training_resumes_identically(tmp_path):
    step, state = trained_state()
    fsg.checkpoint.save(tmp_path / "c", state)
    restored = fsg.checkpoint.restore(tmp_path / "c", like=step.init(fsg.params(mlp(seed=9))))
    assert all(same_bits(x, y) for x, y in zip(tree.flatten(state)[0], tree.flatten(restored)[0]))
    a, _ = step(state, regression_batch(seed=5))
    b, _ = step(restored, regression_batch(seed=5))
    assert all(torch.equal(x, y) for x, y in zip(tree.flatten(a)[0], tree.flatten(b)[0]))


def test_abstract_like_on_the_meta_device_restores_to_cpu(tmp_path):
    state = {"w": torch.randn(3, 2)}
    fsg.checkpoint.save(tmp_path / "c", state)
    restored = fsg.checkpoint.restore(tmp_path / "c", like={"w": torch.empty(3, 2, device="meta")})
    assert restored["w"].device.type == "cpu" and torch.equal(restored["w"], state["w"])


def shard_file(path):
    return path / "shard-00000.msgpack"


def test_corrupted_bytes_name_the_file_and_leaf(tmp_path):
    _, state = trained_state()
    fsg.checkpoint.save(tmp_path / "c", state)
    meta = fsg.checkpoint.read_meta(tmp_path / "c")
    entry = next(e for e in meta["leaves"] if e["path"] == "state.params['2.weight']")
    offset = entry["pieces"][0]["offset"]
    data = bytearray(shard_file(tmp_path / "c").read_bytes())
    data[offset + 3] ^= 0x40
    shard_file(tmp_path / "c").write_bytes(bytes(data))
    with pytest.raises(
        fsg.CheckpointError, match=r"shard-00000.msgpack is corrupt: the checksum of state.params\['2.weight'\]"
    ):
        fsg.checkpoint.restore(tmp_path / "c", like=state)


def test_truncated_and_missing_shards_are_reported(tmp_path):
    _, state = trained_state()
    fsg.checkpoint.save(tmp_path / "c", state)
    size = shard_file(tmp_path / "c").stat().st_size
    with open(shard_file(tmp_path / "c"), "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(fsg.CheckpointError, match=r"shard-00000.msgpack is truncated: state\.skips\.consecutive"):
        fsg.checkpoint.restore(tmp_path / "c", like=state)
    os.remove(shard_file(tmp_path / "c"))
    with pytest.raises(fsg.CheckpointError, match=r"shard-00000.msgpack is missing; it holds pieces of state.step"):
        fsg.checkpoint.restore(tmp_path / "c", like=state)


def test_incomplete_missing_and_existing_checkpoints(tmp_path):
    state = {"w": torch.ones(2)}
    fsg.checkpoint.save(tmp_path / "c", state)
    with pytest.raises(fsg.CheckpointError, match="already exists; a checkpoint is never overwritten"):
        fsg.checkpoint.save(tmp_path / "c", state)
    os.remove(tmp_path / "c" / "COMMIT")
    with pytest.raises(fsg.CheckpointError, match="is incomplete"):
        fsg.checkpoint.restore(tmp_path / "c", like=state)
    with pytest.raises(fsg.CheckpointError, match="no checkpoint at"):
        fsg.checkpoint.restore(tmp_path / "nothing", like=state)


def test_like_with_another_tree_or_dtype_names_the_leaf(tmp_path):
    state = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    fsg.checkpoint.save(tmp_path / "c", state)
    with pytest.raises(fsg.CheckpointError, match=r"lacks \[\"state\['v'\]\"\] and has \[\"state\['b'\]\"\]"):
        fsg.checkpoint.restore(tmp_path / "c", like={"w": torch.ones(2, 3), "v": torch.zeros(3)})
    with pytest.raises(
        fsg.CheckpointError,
        match=r"state\['w'\] \(in .*\): the checkpoint has float32\[2, 3\] but like= has bfloat16\[2, 3\]",
    ):
        fsg.checkpoint.restore(tmp_path / "c", like={"w": torch.ones(2, 3, dtype=torch.bfloat16), "b": torch.zeros(3)})


def test_partial_restore_reads_only_the_subtree(tmp_path):
    _, state = trained_state()
    fsg.checkpoint.save(tmp_path / "c", state)
    # Corrupt every optimizer-state piece: restoring the params alone must not read them.
    meta = fsg.checkpoint.read_meta(tmp_path / "c")
    data = bytearray(shard_file(tmp_path / "c").read_bytes())
    for entry in meta["leaves"]:
        if entry["path"].startswith("state.opt_state") and entry["pieces"]:
            data[entry["pieces"][0]["offset"]] ^= 0xFF
    shard_file(tmp_path / "c").write_bytes(bytes(data))
    params = fsg.checkpoint.restore(tmp_path / "c", like=state.params, select="state.params")
    assert all(torch.equal(params[k], state.params[k]) for k in params)
    with pytest.raises(fsg.CheckpointError, match="corrupt"):
        fsg.checkpoint.restore(tmp_path / "c", like=state)


def test_unencodable_metadata_is_refused_before_writing(tmp_path):
    with pytest.raises(fsg.CheckpointError, match="metadata must be msgpack-encodable"):
        fsg.checkpoint.save(tmp_path / "c", {"w": torch.ones(1)}, metadata={"f": object()})
    assert not (tmp_path / "c").exists()


def test_export_safetensors_is_read_by_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file

    params = {"a.weight": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2).bfloat16()}
    fsg.checkpoint.export_safetensors(tmp_path / "m.safetensors", params, metadata={"step": 7})
    loaded = load_file(tmp_path / "m.safetensors")
    assert sorted(loaded) == sorted(params)
    assert all(torch.equal(loaded[k], params[k]) and loaded[k].dtype == params[k].dtype for k in params)
