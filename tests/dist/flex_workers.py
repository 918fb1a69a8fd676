"""Rank functions for tests/dist/test_flex_attention.py (spawn-importable)."""

import warnings

import torch

import fsg
import fsg.testing
from fsg._src import tree
from tests.dist.workers import preset_rules

T, H, D = 64, 4, 8


def flex_op(q, k, v, slopes, block_mask):
    """torch's ``flex_attention`` operator called directly, an ALiBi score function reading
    ``slopes`` as a declared buffer (or a soft cap reading no index where ``slopes`` is
    ``None``): what ``flex_attention`` calls, without its refusal of a backward on CPU, so that
    CPU tests can train through the operator's backward."""

    def alibi(s, b, h, i, j, slopes):
        return s - slopes[h] * (i - j)

    def softcap(s, b, h, i, j):
        return 20 * torch.tanh(s / 20)

    options = {"BACKEND": "AUTO", "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False, "BLOCKS_ARE_CONTIGUOUS": False,
               "WRITE_DQ": True, "OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}  # fmt: skip
    score, buffers = (softcap, ()) if slopes is None else (alibi, (slopes,))
    scale = q.shape[-1] ** -0.5
    out, _, _ = torch.ops.higher_order.flex_attention(q, k, v, score, block_mask.as_tuple(), scale, options, buffers, ())
    return out


class FlexBlock(torch.nn.Module):
    """FlexAttention between input and output projections. ``variant``: ``"alibi"``, a fused qkv
    projection, a sliding causal window and an ALiBi score function on learned slopes (reads the
    head index); ``"per_sequence"``, the same with a mask of each sequence's own length (reads the
    batch index); ``"heads"``, separate q/k/v projections (tensor parallelism shards their heads)
    and a soft cap that reads no index."""

    def __init__(self, variant: str = "alibi"):
        super().__init__()
        from torch.nn.attention.flex_attention import create_block_mask

        self.variant = variant
        if variant == "per_sequence":  # made once, outside the step (built inside, its CPU Inductor code did not compile)
            lengths = torch.tensor([64, 40, 64, 20])
            self.mask = create_block_mask(lambda b, h, i, j: (i >= j) & (j < lengths[b]), 4, None, T, T, device="cpu")
        if variant == "heads":
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(32, H * D) for _ in range(3))
        else:
            self.qkv = torch.nn.Linear(32, 3 * H * D)
            self.slopes = torch.nn.Parameter(torch.linspace(0.1, 0.5, H))
        self.proj = torch.nn.Linear(H * D, 32)

    def forward(self, x, train=False):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        b = x.shape[0]
        if self.variant == "heads":
            q, k, v = (p(x).view(b, T, H, D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = self.qkv(x).view(b, T, 3, H, D).permute(2, 0, 3, 1, 4)
        if self.variant == "per_sequence":
            mask = self.mask
        else:
            mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j < 24), None, None, T, T, device=x.device)
        slopes = None if self.variant == "heads" else self.slopes

        def alibi(s, b, h, i, j):
            return s - slopes[h] * (i - j)

        def softcap(s, b, h, i, j):
            return 20 * torch.tanh(s / 20)

        # training on CPU calls the operator itself (flex_attention refuses a CPU backward)
        score_mod = softcap if slopes is None else alibi
        y = flex_op(q, k, v, slopes, mask) if train else flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, T, H * D))


def _runs_local(axes: dict, variant: str) -> bool:  # run_local's conditions, for this block
    return variant != "per_sequence" and ("dp" in axes or variant == "heads")


def _check_fallbacks(caught: list, axes: dict, variant: str) -> None:
    replicated = [w for w in caught if issubclass(w.category, fsg.ShardingFallbackWarning) and "flex_attention" in str(w.message)]
    assert bool(replicated) != _runs_local(axes, variant), [str(w.message)[:200] for w in replicated]


def check_flex_attention_eval(axes: dict, preset: str, backend: str, variant: str) -> None:
    """An evaluation step with FlexAttention on a mesh (batch sharded on dp; heads on tp where
    the preset shards the projections) equals the unsharded one; a batch-sharded attention
    or heads runs on each rank's own (no fallback) unless a function reads a sharded index."""
    torch.manual_seed(0)
    model = FlexBlock(variant)

    def metrics(params, x):
        out = fsg.apply(model, params, x)
        return {"loss": out.square().mean(), "out": out}

    mesh = fsg.testing.mesh(axes)
    rules = preset_rules(preset)
    step = fsg.compile_step(lambda p, x: metrics(p, x)["loss"], mesh, optimizer=fsg.optim.sgd(0.1),
                            param_sharding=rules, backend="eager")  # fmt: skip
    state = step.init(fsg.params(model))
    x = torch.randn(4, T, 32, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fsg.compile_eval(metrics, mesh, param_sharding=rules, backend=backend)(state, x)
    _check_fallbacks(caught, axes, variant)
    whole = tree.tree_map(lambda t: t.full_tensor(), state)
    want = fsg.compile_eval(metrics, backend="eager")(whole, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def check_flex_attention_training(axes: dict, preset: str, variant: str) -> None:
    """Training steps through FlexAttention's backward on a mesh (its operator, run on gathered
    inputs: DTensor has no rule for it) equal the unsharded steps: the learned slopes' gradient
    comes through the score function's captured buffer. SGD: the key bias's gradient is zero up
    to rounding (softmax ignores a constant per query), which Adam would scale to full steps."""
    torch.manual_seed(0)
    model = FlexBlock(variant)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(4, T, 32, generator=g) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, batches, axes, preset)
    _check_fallbacks(caught, axes, variant)


def _train(model: FlexBlock, batches: list, axes: dict, preset: str) -> None:
    fsg.testing.assert_sharded_matches_unsharded(
        lambda p, x: fsg.apply(model, p, x, train=True).square().mean(), fsg.params(model), batches,
        fsg.testing.mesh(axes), optimizer=fsg.optim.sgd(0.1), param_sharding=preset_rules(preset),
        batch_sharding=fsg.P("dp") if "dp" in axes else fsg.P(), rtol=1e-5, atol=1e-6, backend="aot_eager",
    )  # fmt: skip


def check_hugging_face_flex_eval(axes: dict, preset: str) -> None:
    """A Hugging Face Llama with ``attn_implementation="flex_attention"`` evaluated on a mesh
    equals the unsharded evaluation, and its attention stays on each rank's sequences: the
    causal mask it builds for the whole batch in each forward is computed once, one for every
    sequence (trace/block_masks.py), so no ``ShardingFallbackWarning`` gathers the batch."""
    from tests.test_flex_attention import flex_llama

    model = flex_llama(64).eval()
    ids = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(1))

    def loss_fn(params, ids):
        return fsg.apply(model, params, input_ids=ids, labels=ids).loss

    mesh, rules = fsg.testing.mesh(axes), preset_rules(preset)
    step = fsg.compile_step(loss_fn, mesh, optimizer=fsg.optim.sgd(0.1), param_sharding=rules, backend="eager")
    state = step.init(fsg.params(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fsg.compile_eval(loss_fn, mesh, param_sharding=rules)(state, ids)
    fallbacks = [str(w.message)[:200] for w in caught if issubclass(w.category, fsg.ShardingFallbackWarning)]
    assert not any("flex_attention" in m for m in fallbacks), fallbacks
    whole = tree.tree_map(lambda t: t.full_tensor(), state)
    torch.testing.assert_close(got, fsg.compile_eval(loss_fn, backend="eager")(whole, ids), rtol=1e-5, atol=1e-6)
