"""``Lowered.memory()``: the static byte counts equal a hand count on an MLP, scale as they should
with the batch, accumulation and donation, and match the live bytes of the graph run eagerly."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fsg
from fsg._src import tree

D_IN, D_OUT = 8, 4
F32 = 4  # bytes


def mlp_step(
    depth: int, width: int, batch_size: int, *, accum_steps: int = 1, donate: bool = True, optimizer=None, ones=False
):
    """``depth`` tanh layers of ``width`` and a linear head, squared error: what the backward
    needs from the forward is each layer's tanh output (``batch x width``), the head's residual
    (``batch x D_OUT``) and the loss (a scalar). The input is the batch, not an activation."""
    torch.manual_seed(0)
    dims = [D_IN] + [width] * depth
    params = {f"w{i}": torch.randn(dims[i], dims[i + 1]) / dims[i] ** 0.5 for i in range(depth)}
    params |= {f"b{i}": torch.zeros(width) for i in range(depth)}
    params["head"] = torch.randn(width, D_OUT)

    def loss_fn(p, b):
        h = b["x"]
        for i in range(depth):
            h = torch.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
        loss = ((h @ p["head"] - b["y"]) ** 2).mean()
        return loss * torch.ones_like(loss) if ones else loss  # a ones_like that is not the backward's seed

    step = fsg.compile_step(
        loss_fn,
        optimizer=optimizer or fsg.optim.adamw(1e-3),
        backend="eager",
        accum_steps=accum_steps,
        donate=donate,
    )
    state = step.init(params)
    batch = {"x": torch.randn(batch_size, D_IN), "y": torch.randn(batch_size, D_OUT)}
    return step.lower(state, batch), state, params


def _nbytes(leaves) -> int:
    return sum(t.numel() * t.element_size() for t in leaves)


@pytest.mark.parametrize("depth, width, batch_size", [(1, 16, 32), (2, 16, 8), (2, 64, 128), (3, 24, 40)])
def test_mlp_memory_equals_the_hand_count(depth, width, batch_size):
    lowered, state, params = mlp_step(depth, width, batch_size)
    memory = lowered.memory()
    assert isinstance(memory, fsg.Memory)
    assert memory.state == _nbytes(tree.flatten(state)[0])
    assert memory.state >= 3 * _nbytes(params.values())  # AdamW: params and two moments
    assert memory.batch == batch_size * (D_IN + D_OUT) * F32
    assert memory.activations == F32 * (depth * batch_size * width + batch_size * D_OUT + 1)
    assert memory.activations <= memory.temporaries_peak
    assert memory.peak == memory.state + memory.batch + memory.temporaries_peak


def test_activations_grow_linearly_with_the_batch_and_the_state_does_not():
    sizes = [8, 16, 32, 64]
    memories = [mlp_step(2, 32, n)[0].memory() for n in sizes]
    assert len({m.state for m in memories}) == 1
    per_row = (memories[1].activations - memories[0].activations) / (sizes[1] - sizes[0])
    assert per_row == F32 * (2 * 32 + D_OUT)
    for n, m in zip(sizes, memories):
        assert m.activations == pytest.approx(memories[0].activations + per_row * (n - sizes[0]))
        assert m.batch == n * (D_IN + D_OUT) * F32


def test_accumulating_two_microbatches_halves_the_activations():
    whole, _, _ = mlp_step(2, 32, 64)
    halves, _, _ = mlp_step(2, 32, 64, accum_steps=2)
    a, b = whole.memory(), halves.memory()
    assert (b.state, b.batch) == (a.state, a.batch)
    # one microbatch's activations, plus the first microbatch's loss (a scalar) kept for the mean,
    # plus the microbatch's input rows: a contiguous copy of them (as a user's batch would be),
    # which the first layer's grad-weight reads
    rows = F32 * 32 * D_IN
    assert b.activations == F32 * (2 * 32 * 32 + 32 * D_OUT + 1) + F32 + rows
    assert b.activations - rows == pytest.approx(a.activations / 2, rel=0.01)


def test_donation_does_not_change_what_the_inputs_hold():
    donated, undonated = (mlp_step(2, 16, 32, donate=d)[0].memory() for d in (True, False))
    assert (donated.state, donated.batch, donated.activations) == (
        undonated.state,
        undonated.batch,
        undonated.activations,
    )


@pytest.mark.parametrize("donate, accum_steps", [(True, 1), (False, 1), (True, 2)])
def test_the_backward_is_found_among_other_scalar_ones(donate, accum_steps):
    """Clipping compares the gradient norm with ``ones_like(norm)``, a constant schedule of 1.0 is
    ``full_like(count, 1.0)``, and the loss may hold a ``ones_like`` of its own: none of them is
    where the backward starts."""
    plain = mlp_step(2, 32, 16, donate=donate, accum_steps=accum_steps)[0]
    clipped = fsg.optim.chain(fsg.optim.clip_by_global_norm(1.0), fsg.optim.adamw(fsg.optim.constant(1.0)))
    busy = mlp_step(2, 32, 16, donate=donate, accum_steps=accum_steps, optimizer=clipped, ones=True)[0]
    ops = busy.op_counts()
    assert ops["aten.ones_like"] >= 3 and ops["aten.full_like"] >= 1
    # the same saved values, and the loss's own ones (a scalar) that its product saves
    assert 0 <= busy.memory().activations - plain.memory().activations <= 8


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages the ops return (the inputs' excepted), each counted from the op
    that makes it until the last tensor on it is garbage: what running the graph really holds."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.live: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors on it]
        self.now = self.peak = 0

    def _release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.now -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.inputs:
                continue
            if key not in self.live:
                self.live[key] = [storage.nbytes(), 0]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.live[key][1] += 1
            weakref.finalize(t, self._release, key)
        return out


def measured_peak(lowered: fsg.Lowered, runs: int = 1) -> int:
    """The most bytes of non-input tensors alive at once while the graph runs eagerly; the
    least of ``runs`` runs (a collective's work object, on its own thread, can hold its
    buffers a moment past their last use in the graph: the graph's own liveness is the least
    a run shows)."""
    peaks = []
    for _ in range(runs):
        inputs = [t.detach().clone() for t in lowered._example_inputs]
        mode = LiveBytes(inputs)
        with torch.no_grad(), mode:
            lowered.graph_module(*inputs)
        peaks.append(mode.peak)
    return min(peaks)


def tiny_gpt_step(accum_steps=1, donate=True, precision=None):
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False))

    def loss_fn(p, b):
        return fsg.nn.cross_entropy(fsg.apply(model, p, b["x"]), b["y"])

    kwargs = {} if precision is None else {"precision": precision}
    step = fsg.compile_step(
        loss_fn, optimizer=fsg.optim.adamw(1e-3), backend="eager", accum_steps=accum_steps, donate=donate, **kwargs
    )
    tokens = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(1))
    return step.lower(step.init(fsg.params(model)), {"x": tokens[:, :-1], "y": tokens[:, 1:]})


BF16 = fsg.Policy(param=torch.float32, compute=torch.bfloat16)


@pytest.mark.parametrize(
    "make",
    [
        lambda: mlp_step(2, 64, 128)[0],
        lambda: mlp_step(3, 32, 64, accum_steps=2)[0],
        lambda: mlp_step(2, 16, 32, donate=False)[0],
        lambda: tiny_gpt_step(),
        lambda: tiny_gpt_step(accum_steps=2),
        lambda: tiny_gpt_step(donate=False, precision=BF16),
    ],
    ids=["mlp", "mlp-accum2", "mlp-undonated", "gpt", "gpt-accum2", "gpt-undonated-bf16"],
)
def test_the_static_peak_is_what_running_the_graph_eagerly_holds(make):
    """Run op by op in the graph's order, on CPU, the graph holds exactly the static count of
    live temporaries at its peak (the stated tolerance, 5%, is for allocator-independent
    differences a future torch might bring: a kernel that returns a view where its schema says
    new tensor); it never holds more."""
    lowered = make()
    static, measured = lowered.memory().temporaries_peak, measured_peak(lowered)
    assert measured <= static <= 1.05 * measured, (static, measured)
