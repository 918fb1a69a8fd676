"""The README's main example runs end to end and learns (short run, aot_eager)."""

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_gpt  # noqa: E402


def test_train_gpt_learns_below_the_unigram_baseline(tmp_path, capsys):
    result = train_gpt.main(
        ["--steps", "120", "--backend", "aot_eager", "--eval-every", "60", "--sample-every", "120",
         "--n-layer", "2", "--n-embd", "64", "--warmup", "20", "--out", str(tmp_path)]
    )  # fmt: skip
    assert result["val_loss"] < result["unigram"] - 0.4
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    out = capsys.readouterr()
    assert "--- sample at step 120" in out.out + out.err


def test_train_gpt_learns_with_muon(tmp_path):
    """``--optimizer muon``: Muon for the blocks' matrices, AdamW groups for the rest."""
    result = train_gpt.main(
        ["--steps", "120", "--backend", "aot_eager", "--eval-every", "60", "--sample-every", "1000",
         "--n-layer", "2", "--n-embd", "64", "--warmup", "20", "--optimizer", "muon", "--out", str(tmp_path)]
    )  # fmt: skip
    assert result["val_loss"] < result["unigram"] - 0.4
