"""examples/resnet.py: a small ResNet-18 with BatchNorm learns the generated images through
compile_step, and compile_eval measures it along the way (issue 21)."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import resnet  # noqa: E402


def test_resnet_learns_and_evaluates():
    args = (
        "--width 4 --image-size 16 --batch-size 32 --steps 30 --eval-every 15 --eval-size 64 --lr 1e-2 --backend eager"
    )
    history = resnet.main(args.split())
    losses = history["loss"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2
    assert [s for s, _, _ in history["eval"]] == [15, 30]
    assert all(math.isfinite(loss) and 0.0 <= acc <= 1.0 for _, loss, acc in history["eval"])


def test_images_are_deterministic_and_balanced():
    a, b = resnet.make_images(200, 16, seed=3), resnet.make_images(200, 16, seed=3)
    assert a["x"].shape == (200, 3, 16, 16) and a["x"].equal(b["x"]) and a["y"].equal(b["y"])
    assert not a["x"].equal(resnet.make_images(200, 16, seed=4)["x"])
    assert set(a["y"].tolist()) == set(range(resnet.CLASSES))
