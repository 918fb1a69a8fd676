"""What a training script reports, shared by the examples: per-step metrics to a JSONL file, a
progress bar on a terminal (plain lines otherwise), and one log per rank under torchrun.

Metrics stay 0-d device tensors until ``flush`` (every ``flush_every`` steps), which converts
them all at once: one host sync per flush, not one per step. Rank 0 writes the JSONL file and
prints; rank ``r > 0`` writes its lines to ``OUT/rank{r}.log``. A resumed run appends to the
file, re-logging the steps it redoes; ``read_metrics`` keeps the last record of each step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

try:
    from tqdm import tqdm
except ImportError:  # the bar is optional: plain lines without it
    tqdm = None

# Dense bfloat16 peak FLOP/s per GPU, the usual MFU denominator (nanoGPT, PaLM appendix B),
# matched by a substring of torch.cuda.get_device_name(). Unknown GPUs get no MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def peak_flops(device: torch.device) -> float | None:
    """The table's peak for ``device``'s GPU, or ``None`` (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def read_metrics(path: str | Path) -> dict[int, dict]:
    """The records of a metrics file by step; where a resumed run re-logged a step, its last."""
    records = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[record["step"]] = record
    return dict(sorted(records.items()))


def _number(value) -> float:
    value = value.to_local() if hasattr(value, "to_local") else value  # replicated DTensor metrics
    return float(value)


class RunLog:
    """Per-step metrics, progress and messages of one rank of a run.

    Args:
      out: the run's folder (rank logs go here).
      rank: this process's rank; 0 prints and writes ``metrics_file``.
      total_steps: the run's last step (for the bar).
      start_step: the steps already done (a resumed run starts after them).
      tokens_per_step: tokens of one global batch, for tokens/s.
      metrics_file: the JSONL file; appended to when ``start_step > 0``, else started afresh.
      flush_every: steps between host syncs (conversions, file writes, progress).
      flops_per_step: FLOPs of one step on one device, for the MFU estimate (with ``peak``).
      peak: the device's peak FLOP/s (``peak_flops(device)``); no MFU when ``None``.
      extra: fields added to every record (e.g. the torchrun attempt).
    """

    def __init__(
        self,
        out: Path,
        *,
        rank: int,
        total_steps: int,
        start_step: int,
        tokens_per_step: int,
        metrics_file: Path,
        flush_every: int = 10,
        flops_per_step: float | None = None,
        peak: float | None = None,
        extra: dict | None = None,
    ):
        self.rank, self.total_steps, self.flush_every = rank, total_steps, flush_every
        self.tokens_per_step, self.flops_per_step, self.peak = tokens_per_step, flops_per_step, peak
        self.extra = extra or {}
        self.records: list[dict] = []  # this process's records, flushed
        self._pending: list[tuple[int, dict]] = []
        self._file = self._rank_log = self.bar = None
        # The bar starts at the first restart_clock() (after the compile) or flush: a bar shown
        # during the compile sits at 0 and its rate and ETA count the compile as training.
        self._bar_pending = rank == 0 and tqdm is not None and sys.stdout.isatty()
        self._start_step = start_step
        out.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(metrics_file, "a" if start_step else "w")  # noqa: SIM115 - closed by close()
        else:
            self._rank_log = open(out / f"rank{rank}.log", "a")  # noqa: SIM115
        self._t_flush, self._untimed = time.perf_counter(), 0

    def print(self, message: str) -> None:
        """A message: printed on rank 0 (above the bar), written to ``rank{r}.log`` elsewhere."""
        if self._rank_log is not None:
            self._rank_log.write(message + "\n")
            self._rank_log.flush()
        elif self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def restart_clock(self) -> None:
        """Starts the tokens/s interval now, leaving out the steps held so far (call it after a
        compile or an evaluation, so that neither counts as training time); the first call starts
        the progress bar, at the last step held."""
        self._start_bar(self._pending[-1][0] if self._pending else self._start_step)
        self._t_flush, self._untimed = time.perf_counter(), len(self._pending)

    def _start_bar(self, initial: int) -> None:
        if self._bar_pending:
            self._bar_pending = False
            self.bar = tqdm(
                initial=initial,
                total=self.total_steps,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0,
                file=sys.stdout,
            )

    def step(self, step: int, metrics: dict) -> None:
        """Records ``step``'s metrics (device tensors, held until the next flush)."""
        self._pending.append((step, metrics))
        if step % self.flush_every == 0 or step == self.total_steps:
            self.flush()

    def flush(self) -> list[dict]:
        """Converts the held metrics (the host sync), writes them, updates the progress."""
        if not self._pending:
            return []
        elapsed, timed = time.perf_counter() - self._t_flush, len(self._pending) - self._untimed
        steps_per_s = timed / elapsed if timed and elapsed > 0 else None  # None: no step was timed
        new = []
        for step, metrics in self._pending:
            record = {"step": step, **self.extra}
            for name in ("loss", "grad_norm", "lr", "loss_scale"):
                if name in metrics:
                    record[name] = _number(metrics[name])
            if "skipped" in metrics:
                record["skipped"] = int(_number(metrics["skipped"]))
            record["tokens_per_s"] = steps_per_s and self.tokens_per_step * steps_per_s  # the interval's average
            if steps_per_s and self.flops_per_step and self.peak:
                record["mfu"] = self.flops_per_step * steps_per_s / self.peak
            new.append(record)
        self._pending = []
        self.records += new
        last = new[-1]
        self._start_bar(self._start_step)
        if self._file is not None:
            self._file.writelines(json.dumps(r) + "\n" for r in new)
            self._file.flush()
        if self.bar is not None:
            self.bar.update(last["step"] - self.bar.n)
            self.bar.set_postfix(loss=f"{last['loss']:.3f}", lr=f"{last['lr']:.1e}")
            if last["step"] == self.total_steps:  # done: later messages print below the finished bar
                self.bar.close()
                self.bar = None
        else:
            speed = f", {last['tokens_per_s']:,.0f} tokens/s" if last["tokens_per_s"] else ""
            speed += f", MFU {last['mfu']:.1%}" if "mfu" in last else ""
            self.print(
                f"step {last['step']}/{self.total_steps}: loss {last['loss']:.4f}, lr {last['lr']:.2e}, "
                f"grad norm {last['grad_norm']:.3f}{speed}"
            )
        self._t_flush, self._untimed = time.perf_counter(), 0
        return new

    def close(self) -> None:
        """Flushes what is held and closes the bar and files."""
        self.flush()
        if self.bar is not None:
            self.bar.close()
        for f in (self._file, self._rank_log):
            if f is not None:
                f.close()
