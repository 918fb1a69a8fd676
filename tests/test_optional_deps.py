"""fsg without its optional dependencies: triton and hypothesis made unimportable.

Each check runs in a fresh interpreter (``sys.executable -c``) where ``sys.modules`` maps
``triton`` and ``hypothesis`` to ``None``: importing either (or a submodule) raises
``ModuleNotFoundError`` and ``importlib.util.find_spec`` returns ``None``, as on a machine
where neither is installed. (A ``sys.meta_path`` finder that raises is not enough: torch asks
``find_spec`` about hypothesis while it loads Dynamo, and would fail on the raise.)
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HIDE = """
import sys

sys.modules["triton"] = sys.modules["hypothesis"] = None
"""


def run_without_optional_deps(body: str) -> str:
    """Runs ``body`` after hiding triton and hypothesis; returns its stdout (fails the test,
    showing stderr, if it exits non-zero)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = HIDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_fsg_imports_and_trains_without_triton_and_hypothesis():
    out = run_without_optional_deps(
        """
        import logging

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("fsg").addHandler(handler)
        logging.getLogger("fsg").setLevel(logging.INFO)

        import torch

        import fsg
        import fsg.checkpoint
        import fsg.nn
        import fsg.optim
        import fsg.testing
        from fsg._src.kernels import _common

        assert sys.modules["triton"] is None and sys.modules["hypothesis"] is None  # still hidden
        assert not _common.HAS_TRITON
        said = [r.getMessage() for r in records if "triton" in r.getMessage()]
        assert len(said) == 1 and "eager" in said[0], said

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)

        def loss_fn(params, batch):
            return fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])

        # fused_optimizer=True also puts the fused AdamW op in the graph: it runs its reference.
        step = fsg.compile_step(loss_fn, optimizer=fsg.optim.adamw(1e-2), backend="eager", fused_optimizer=True)
        state = step.init(fsg.params(model), seed=0)
        batch = {"x": torch.randn(8, 4), "y": torch.randint(0, 3, (8,))}
        losses = []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        assert int(state.step) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
        assert losses[1] < losses[0], losses

        try:
            fsg.testing.mesh_strategy
        except ImportError as exc:
            assert "pip install hypothesis" in str(exc), exc
        else:
            raise AssertionError("fsg.testing.mesh_strategy worked without hypothesis")
        print("ok")
        """
    )
    assert out.strip().endswith("ok")
