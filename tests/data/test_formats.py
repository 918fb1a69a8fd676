"""Token files: round trips of both formats, ``prepare``, and every bad input named clearly."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fsg
import fsg.data


@st.composite
def token_file_strategy(draw):
    """(format, token ids) for a token file."""
    fmt = draw(st.sampled_from(["llmc", "nanogpt"]))
    high = 2**32 - 1 if fmt == "llmc" and draw(st.booleans()) else 2**16 - 1
    return fmt, draw(st.lists(st.integers(0, high), min_size=1, max_size=200))


@given(token_file_strategy())
def test_token_files_round_trip(tmp_path_factory, case):
    fmt, ids = case
    path = fsg.data.write_tokens(tmp_path_factory.mktemp("tok") / "t.bin", ids, format=fmt)
    src = fsg.data.TokenFile(path)
    assert src.format == fmt and len(src) == len(ids)
    assert src.rows(np.array([0]), len(ids)).tolist() == [ids]


def test_nanogpt_file_is_raw_uint16(tmp_path):
    np.array([5, 6, 7], dtype=np.uint16).tofile(tmp_path / "raw.bin")
    assert fsg.data.read_layout(tmp_path / "raw.bin") == ("nanogpt", 0, 3, np.uint16)


def test_llmc_header_is_llm_c_s(tmp_path):
    fsg.data.write_tokens(tmp_path / "t.bin", [1, 2, 3])
    header = np.fromfile(tmp_path / "t.bin", dtype=np.int32, count=256)
    assert header[:3].tolist() == [20240520, 1, 3] and (tmp_path / "t.bin").stat().st_size == 1024 + 6


def write_header(path, magic=20240520, version=1, count=10, tokens=10, extra=b""):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (magic, version, count)
    path.write_bytes(header.tobytes() + np.arange(tokens, dtype=np.uint16).tobytes() + extra)
    return path


@pytest.mark.parametrize(
    "make, fmt, words",
    [
        (lambda p: p.write_bytes(b"\x01\x00\x02"), "auto", ["3 bytes", "odd"]),
        (lambda p: p.write_bytes(b""), "auto", ["empty"]),
        (lambda p: write_header(p, count=20), "auto", ["20 tokens", "1044 bytes", "truncated"]),
        (lambda p: write_header(p, extra=b"\x00"), "auto", ["1045 bytes", "longer than its header"]),
        (lambda p: write_header(p, magic=1234), "llmc", ["magic is 1234", "20240520"]),
        (lambda p: write_header(p, version=7), "auto", ["version is 7"]),
        (lambda p: write_header(p, count=-5), "auto", ["-5 tokens"]),
        (lambda p: p.write_bytes(b"\x00" * 100), "llmc", ["100 bytes", "fewer than"]),
        (lambda p: None, "auto", ["does not exist"]),
        (lambda p: write_header(p), "gzip", ["'gzip'"]),
    ],
    ids=["odd-sized", "empty", "truncated", "trailing-bytes", "wrong-magic", "wrong-version", "negative-count",
         "shorter-than-header", "missing", "unknown-format"],
)  # fmt: skip
def test_a_bad_token_file_names_the_file_and_the_value(tmp_path, make, fmt, words):
    path = tmp_path / "bad.bin"
    make(path)
    with pytest.raises(fsg.data.DataError) as info:
        fsg.data.TokenFile(path, format=fmt)
    assert str(path) in str(info.value)
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, fsg.FsgError)


def test_a_token_id_beyond_the_vocabulary_names_file_position_and_id(tmp_path):
    path = fsg.data.write_tokens(tmp_path / "t.bin", [1] * 50 + [300] + [1] * 49)
    loader = fsg.data.Loader(path, batch_size=11, seq_len=9, vocab_size=256, prefetch=0)  # all 11 windows
    with pytest.raises(
        fsg.data.DataError, match=r"t\.bin: token id 300 at token 50 is at or beyond the vocabulary size 256"
    ):
        next(loader)


def test_a_token_id_beyond_the_vocabulary_is_raised_from_the_prefetch_thread(tmp_path):
    path = fsg.data.write_tokens(tmp_path / "t.bin", [1] * 50 + [300] + [1] * 49)
    loader = fsg.data.Loader(path, batch_size=11, seq_len=9, vocab_size=256, prefetch=2)
    with loader, pytest.raises(fsg.data.DataError, match="token id 300"):
        next(loader)


def test_a_sequence_longer_than_the_data(tmp_path):
    path = fsg.data.write_tokens(tmp_path / "t.bin", list(range(10)))
    with pytest.raises(
        fsg.data.DataError, match=r"t\.bin: seq_len=10 needs windows of 11 tokens but the data holds 10"
    ):
        fsg.data.Loader(path, batch_size=1, seq_len=10)
    with pytest.raises(fsg.data.DataError, match=r"a global batch of 4 rows needs 4 windows .* holds 3"):
        fsg.data.Loader(path, batch_size=4, seq_len=3)


def test_a_batch_that_does_not_divide_over_the_data_ranks():
    with pytest.raises(
        fsg.data.DataError, match=r"tokens\): the global batch of 6 rows does not divide over 4 data ranks"
    ):
        fsg.data.Loader(torch.arange(100), batch_size=6, seq_len=4, rank=0, num_ranks=4)


def test_bad_in_memory_tokens_and_arguments():
    with pytest.raises(fsg.data.DataError, match="1-d integer tensor; got torch.float32"):
        fsg.data.Tokens(torch.zeros(10))
    with pytest.raises(fsg.data.DataError, match="non-negative; got -3 at index 2"):
        fsg.data.Tokens(torch.tensor([1, 2, -3]))
    with pytest.raises(fsg.data.DataError, match="got list"):
        fsg.data.Loader([1, 2, 3], batch_size=1, seq_len=1)
    with pytest.raises(fsg.FsgError, match=r"seq_len=...\) must be an int >= 1; got int 0"):
        fsg.data.Loader(torch.arange(10), batch_size=1, seq_len=0)


def test_nothing_is_read_past_the_end(tmp_path):
    src = fsg.data.Tokens(torch.arange(10))
    with pytest.raises(fsg.data.DataError, match=r"\[8, 11\) reaches past the end of its 10 tokens"):
        src.rows(np.array([0, 8]), 3)
    # a file whose windows end exactly at its last token: many epochs, never a token beyond
    path = fsg.data.write_tokens(tmp_path / "t.bin", list(range(25)), format="nanogpt")
    loader = fsg.data.Loader(path, batch_size=3, seq_len=4, prefetch=0)  # 6 windows, the last ends at token 24
    served = torch.cat([next(loader) for _ in range(10)])
    assert int(served.max()) == 24 and loader.epoch == 5


def test_restore_refuses_a_state_of_other_data():
    a = fsg.data.Loader(torch.arange(100), batch_size=2, seq_len=4, prefetch=0)
    b = fsg.data.Loader(torch.arange(100), batch_size=2, seq_len=5, prefetch=0)
    with pytest.raises(fsg.data.DataError, match="saved loader state is over 24 windows but this loader has 19"):
        b.restore(a.state_dict())
    with pytest.raises(fsg.data.DataError, match="keys"):
        b.restore({"seed": 0})


def test_prepare_bytes(tmp_path):
    (tmp_path / "a.txt").write_text("héllo\n")
    (tmp_path / "b.txt").write_text("world")
    out, count, tok = fsg.data.prepare(
        [tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "o.bin", tokenizer_name="bytes"
    )
    src = fsg.data.TokenFile(out)
    assert count == len(src) == 12 and tok.vocab_size == 256
    assert bytes(src.rows(np.array([0]), 12)[0].tolist()).decode() == "héllo\nworld"


def test_prepare_command_line(tmp_path):
    (tmp_path / "in.txt").write_text("abc " * 100)
    run = subprocess.run(
        [sys.executable, "-m", "fsg.data", "prepare", str(tmp_path / "in.txt"), str(tmp_path / "out.bin"),
         "--tokenizer", "bytes", "--format", "nanogpt"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "wrote 400 tokens (bytes, vocabulary 256)" in run.stdout
    assert fsg.data.read_layout(tmp_path / "out.bin").format == "nanogpt"
    bad = subprocess.run([sys.executable, "-m", "fsg.data", "prepare", str(tmp_path / "no.txt"), str(tmp_path / "o.bin")],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "no.txt does not exist" in bad.stderr


def test_prepare_with_an_unknown_tokenizer():
    with pytest.raises(fsg.data.DataError, match="'sentencepiece' is not one of"):
        fsg.data.prepare([], "o.bin", tokenizer_name="sentencepiece")
