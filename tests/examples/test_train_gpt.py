"""The README's main example runs end to end and learns (short run, aot_eager)."""

import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_gpt  # noqa: E402


def small_run(tmp_path, *extra: str) -> dict:
    """120 steps of a 2-layer, width-64 model under aot_eager, evaluated at steps 60 and 120."""
    args = [
        "--steps",
        "120",
        "--backend",
        "aot_eager",
        "--eval-every",
        "60",
        "--n-layer",
        "2",
        "--n-embd",
        "64",
        "--warmup",
        "20",
    ]
    return train_gpt.main([*args, *extra, "--out", str(tmp_path)])


def test_train_gpt_learns_below_the_unigram_baseline(tmp_path, capsys):
    result = small_run(tmp_path, "--sample-every", "120")
    assert result["val_loss"] < result["unigram"] - 0.4
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    out = capsys.readouterr()
    assert "--- sample at step 120" in out.out + out.err


def test_train_gpt_learns_with_muon(tmp_path):
    """``--optimizer muon``: Muon for the blocks' matrices, AdamW groups for the rest."""
    result = small_run(tmp_path, "--sample-every", "1000", "--optimizer", "muon")
    assert result["val_loss"] < result["unigram"] - 0.4


def test_cpu_threads_stay_within_the_cores_and_follow_the_flag_and_env(monkeypatch):
    """``--threads`` wins; ``OMP_NUM_THREADS`` leaves torch's count; else between 1 and the cores."""
    assert train_gpt.cpu_threads(3) == (3, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert train_gpt.cpu_threads(None) == (train_gpt.torch.get_num_threads(), "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    n, why = train_gpt.cpu_threads(None)
    assert 1 <= n <= min(len(os.sched_getaffinity(0)), train_gpt.torch.get_num_threads()) and "load average" in why


def test_main_leaves_the_callers_thread_count(tmp_path):
    before = train_gpt.torch.get_num_threads()
    args = f"--steps 2 --backend eager --threads {before + 1} --eval-every 1000 --sample-every 1000 --n-layer 1 --n-embd 32"
    train_gpt.main([*args.split(), "--out", str(tmp_path)])
    assert train_gpt.torch.get_num_threads() == before
