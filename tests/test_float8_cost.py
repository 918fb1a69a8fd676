"""``fsg.Float8(filter="auto")``: the float8 pass's cost model (``passes/float8/cost.py``).

The selection is checked against brute force over hypothesis-drawn layers, casts and costs; the
model's pricing on small joint graphs (a cast fused into a layer norm costs its write alone, an
unfused one three passes and two launches) with measurements given as a table; and the real
thing on CPU: a GPT step with ``filter="auto"`` measured on this machine equals, bit for bit,
the step with an explicit filter naming the layers it chose."""

import itertools
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fsg
from fsg._src.errors import ArgumentError
from fsg._src.passes.float8 import cost as float8_cost
from fsg._src.passes.float8 import matmuls as float8_pass
from fsg._src.passes.options import Fusions
from tests.test_float8 import _gpt_batches, _gpt_step, joint


class TableTimer:
    """Measurements as a table: every bf16 GEMM 1 s, every FP8 GEMM ``1 - saved``, a copy
    bandwidth and a launch time."""

    name = "table"

    def __init__(self, saved: float, bandwidth: float = 1e9, launch: float = 0.0) -> None:
        self.saved_s, self.bandwidth, self.launch_s = saved, bandwidth, launch

    def gemm(self, m, k, n, dtype, fp8, rowwise, fast):
        return 1.0 - self.saved_s if fp8 else 1.0

    def bytes_per_second(self):
        return self.bandwidth

    def launch(self):
        return self.launch_s


# --- the selection: exact, against brute force ------------------------------------------------


def objective(gains, casts, costs, chosen):
    return sum(gains[g] for g in chosen) - sum(costs[c] for c in set().union(*(casts[g] for g in chosen)))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_select_finds_the_best_set_of_layers(data):
    n_layers, n_casts = data.draw(st.integers(1, 7)), data.draw(st.integers(1, 6))
    money = st.floats(-5, 10, allow_nan=False).map(lambda v: round(v, 3))
    gains = {f"L{i}": data.draw(money) for i in range(n_layers)}
    costs = {f"c{j}": abs(data.draw(money)) for j in range(n_casts)}
    casts = {layer: set(data.draw(st.lists(st.sampled_from(sorted(costs)), max_size=4))) for layer in gains}
    chosen = float8_cost.select(gains, casts, costs)
    best = max(
        objective(gains, casts, costs, subset)
        for r in range(n_layers + 1)
        for subset in itertools.combinations(gains, r)
    )
    assert objective(gains, casts, costs, chosen) == pytest.approx(best, abs=1e-9)
    assert all(gains[g] > 0 for g in chosen)  # a layer that saves nothing never runs in FP8


def test_a_shared_cast_is_paid_once():
    # q and k each save 3.5 and read the input's cast (cost 4) and their own weight's (cost 1):
    # alone neither pays (3.5 < 5), together they do (7 > 4 + 1 + 1)
    gains, costs = {"q": 3.5, "k": 3.5}, {"x": 4.0, "wq": 1.0, "wk": 1.0}
    casts = {"q": {"x", "wq"}, "k": {"x", "wk"}}
    assert float8_cost.select(gains, casts, costs) == {"q", "k"}  # 7 > 6: both
    assert float8_cost.select({"q": 3.5, "k": 2.0}, casts, costs) == set()  # 5.5 < 6, and q alone 3.5 < 5
    assert float8_cost.select({"q": 3.5}, {"q": {"x", "wq"}}, costs) == set()
    assert float8_cost.select({"q": 5.5}, {"q": {"x", "wq"}}, costs) == {"q"}


# --- the pricing, on joint graphs -------------------------------------------------------------


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _two_layers(x, z, w1, w2, c1, c2):
    """Two linear layers of one shape: one reads a layer norm's output (its cast fused into the
    norm), the other a product (no fused producer)."""
    y1 = F.layer_norm(x, (x.shape[-1],)) @ w1.t()
    return _with_plain_product(y1, x, z, w2, c1, c2)


def _gated_and_plain(x, z, w1, w2, c1, c2):
    """As ``_two_layers``, the first layer reading a gated MLP's product ``silu(x) * z`` (its
    cast fused into ``gated_fp8``)."""
    return _with_plain_product((F.silu(x) * z) @ w1.t(), x, z, w2, c1, c2)


def _with_plain_product(y1, x, z, w2, c1, c2):
    y2 = (x * z) @ w2.t()
    return ((y1.float() * c1.float()).sum() + (y2.float() * c2.float()).sum(),)


R, D, N = 32, 64, 48  # tokens, the layers' input width, their output width


def _graph(first="layer norm"):
    inputs = (
        bf16(R, D),
        bf16(R, D, seed=1),
        bf16(N, D, seed=2),
        bf16(N, D, seed=3),
        bf16(R, N, seed=4),
        bf16(R, N, seed=5),
    )
    fn = _two_layers if first == "layer norm" else _gated_and_plain
    return joint(fn, *inputs, grad_of=(0, 2, 3)), inputs


def _rewrite(gm, filter, fusions=None):
    config = fsg.Float8(recipe="rowwise", filter=filter, keep_output_head=False)
    return float8_pass.rewrite(gm, float8_pass.Float8Plan(config, {2: "w1", 3: "w2"}, 0), fusions or Fusions())


def model_costs(bandwidth):
    """Each layer's cast costs, from the documented model (module docstring), launch 0: x's
    cast fused into the norm (its write: R D + 4 R bytes) or not ((3 e + 1) R D bytes, e = 2);
    the weight's two casts (along K for the forward, along N for the grad-input) and dY's, unfused."""
    unfused = lambda rows, width: 7 * rows * width / bandwidth  # noqa: E731
    shared = 2 * unfused(N, D) + unfused(R, N)
    return (R * D + 4 * R) / bandwidth + shared, unfused(R, D) + shared


@pytest.mark.parametrize("first", ["layer norm", "gated product"])
@pytest.mark.parametrize("where", ["below both", "between", "above both"])
def test_a_cast_fused_into_its_producer_is_priced_at_its_write(monkeypatch, caplog, where, first):
    unfused_weights = Fusions(fp8_weights=False)  # the weights' casts unfused, as model_costs prices them
    fused_cost, unfused_cost = model_costs(1e9)
    assert fused_cost < unfused_cost
    per_matmul = {"below both": fused_cost / 2 * 0.9, "between": (fused_cost + unfused_cost) / 4,
                  "above both": unfused_cost / 2 * 1.1}[where]  # fmt: skip
    monkeypatch.setattr(float8_cost, "timer_for", lambda device: TableTimer(per_matmul))
    gm, inputs = _graph(first)
    with caplog.at_level(logging.DEBUG, logger="fsg"):
        summary = _rewrite(gm, "auto", unfused_weights)  # rowwise: each layer's forward and grad-input in FP8
    expected = {"below both": 0, "between": 2, "above both": 4}[where]
    assert summary == f"{expected} of 6 matmuls in FP8"
    explicit, _ = _graph(first)
    filters = {"below both": lambda n: False, "between": lambda n: n == "w1", "above both": None}
    _rewrite(explicit, filters[where], unfused_weights)
    for got, want in zip(gm(*inputs), explicit(*inputs)):
        assert torch.equal(got, want)  # the same step as the explicit filter's
    stays = {m.group(1) for r in caplog.records if (m := re.search(r"float8: (\S+) stays: its FP8", r.getMessage()))}
    assert stays == {"below both": {"w1", "w2"}, "between": {"w2"}, "above both": set()}[where]  # w1's cast fused


def test_launches_count_for_unfused_casts_only(monkeypatch):
    """A launch time large enough to sink any unfused cast leaves no layer in FP8 here (each
    layer's weight and gradient casts are unfused); with no launch cost and free bytes, all."""
    monkeypatch.setattr(float8_cost, "timer_for", lambda device: TableTimer(1e-3, bandwidth=1e30, launch=1.0))
    gm, _ = _graph()
    assert _rewrite(gm, "auto") == "0 of 6 matmuls in FP8"
    monkeypatch.setattr(float8_cost, "timer_for", lambda device: TableTimer(1e-3, bandwidth=1e30, launch=0.0))
    gm, _ = _graph()
    assert _rewrite(gm, "auto") == "4 of 6 matmuls in FP8"


@pytest.mark.parametrize("flip", [False, True])
def test_a_weights_fused_casts_are_priced_as_half_their_op(flip):
    """With ``Fusions.fp8_weights`` each of a weight's two casts costs half of ``fsg::weight_fp8``: two
    reads of the weight (bf16 here: a compute-dtype input) and both writes, ``(2 + 1) N D``
    bytes, and one launch; without it the generic cast's ``(3 * 2 + 1) N D`` and two."""
    gm, _ = _graph()
    w1 = [n for n in gm.graph.nodes if n.op == "placeholder"][2]
    timer = TableTimer(0.0, bandwidth=1e9, launch=1e-6)
    for fuse, (nbytes, launches) in ((True, (3, 1)), (False, (7, 2))):
        want = nbytes * N * D / 1e9 + launches * 1e-6
        assert float8_cost.cast_cost(w1, flip, True, timer, Fusions(fp8_weights=fuse)) == pytest.approx(want, rel=1e-12)


# --- the real thing, measured on this machine -------------------------------------------------


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_auto_measured_here_equals_the_explicit_filter_it_chose(caplog, recipe):
    batches = _gpt_batches(2)
    auto = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe=recipe, filter="auto"))
    step, state = _gpt_step(auto)
    with caplog.at_level(logging.DEBUG, logger="fsg"):
        lowered = step.lower(state, batches[0])
    decision = [r.getMessage() for r in caplog.records if "filter='auto') on cpu" in r.getMessage()]
    assert len(decision) == 1 and re.search(r": (\d+) of 8 linear layers in FP8", decision[0]), decision
    stays = {m.group(1) for r in caplog.records if (m := re.search(r"float8: (\S+) stays: its FP8", r.getMessage()))}
    assert len(stays) == 8 - int(re.search(r": (\d+) of 8", decision[0]).group(1))
    explicit = fsg.Policy(compute=torch.bfloat16, matmul=fsg.Float8(recipe=recipe, filter=lambda n: n not in stays))
    other, other_state = _gpt_step(explicit)
    assert lowered.op_counts() == other.lower(other_state, batches[0]).op_counts()
    for batch in batches:
        state, metrics = step(state, batch)
        other_state, other_metrics = other(other_state, batch)
        assert torch.equal(metrics["loss"], other_metrics["loss"])
    for a, b in zip(state.params.values(), other_state.params.values()):
        assert torch.equal(a, b)


def test_device_timer_measures_and_caches():
    timer = float8_cost.DeviceTimer(torch.device("cpu"), reps=2)
    t = timer.gemm(64, 32, 16, torch.bfloat16, False, True, False)
    assert t > 0 and timer.gemm(64, 32, 16, torch.bfloat16, False, True, False) == t  # cached
    assert timer.gemm(64, 32, 16, torch.bfloat16, True, True, True) > 0  # FP8 runs on CPU (emulated)
    assert timer.bytes_per_second() > 1e6 and 0 < timer.launch() < 1


@pytest.mark.parametrize("bad", ["Auto", "none", "cost"])
def test_a_filter_string_other_than_auto_is_refused(bad):
    with pytest.raises(ArgumentError, match="'auto'"):
        fsg.Float8(filter=bad)
