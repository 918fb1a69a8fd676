"""The op corpus (issue 14): every case sharded equals the unsharded step, or raises a clear
``fsg.FsgError``; never a silent mismatch.

Each case of ``op_corpus.CASES`` trains one SGD step under data parallel and FSDP (and tensor
parallel where the case says so: 1-D ``tp`` on 2 ranks, 2 x 2 FSDP x TP on 4), on 2 and 4
gloo ranks, at sizes hypothesis draws per case, and is compared with the unsharded step.
CI runs ``CI_CASES`` (62 cases covering every group); ``FSG_CORPUS=full`` runs all of them.
Outcomes must equal the table in ``docs/sharding.md`` (``FSG_CORPUS_UPDATE_DOCS=1``
regenerates it from a full run).
"""

import os

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.dist import corpus_table, corpus_workers, op_corpus

CI_CASES = (
    # losses: the ones issue 14 saw silently wrong, their reductions, and the classification family
    "((o - y) ** 2).mean() (by hand)", "F.mse_loss", "F.mse_loss(reduction='sum')", "F.l1_loss",
    "F.huber_loss", "F.smooth_l1_loss", "F.binary_cross_entropy(torch.sigmoid(o), t)",
    "F.binary_cross_entropy_with_logits", "F.binary_cross_entropy_with_logits(pos_weight=...)",
    "F.soft_margin_loss", "F.cross_entropy", "F.cross_entropy(weight=class weights)",
    "F.cross_entropy(ignore_index=-100)", "F.cross_entropy(label_smoothing=0.1)",
    "F.cross_entropy([B, C, T] logits, ignore_index)", "F.nll_loss(F.log_softmax(o))",
    "F.nll_loss(weight=class weights, ignore_index=-100)", "F.kl_div(reduction='batchmean')",
    "F.poisson_nll_loss", "F.cosine_embedding_loss", "F.multi_margin_loss", "fsg.nn.linear_cross_entropy",
    # layers
    "nn.Linear -> nn.ReLU -> nn.Linear", "nn.Conv1d(padding=1)", "nn.Conv1d + nn.GroupNorm",
    "nn.Conv2d(stride=2) + nn.BatchNorm2d (training)", "nn.BatchNorm1d (training, batch statistics)",
    "nn.LayerNorm", "F.rms_norm(weight)", "fsg.nn.layer_norm", "nn.Embedding", "F.dropout(p=0.0, training=True)",
    "F.max_pool1d(2)", "F.adaptive_avg_pool2d(3)", "F.avg_pool2d(2)",
    "F.scaled_dot_product_attention(is_causal=True)",
    "F.scaled_dot_product_attention(attn_mask=bool padding mask)",
    # ops
    "F.gelu(approximate='tanh')", "torch.softmax(dim=-1)", "torch.logsumexp(dim=-1)",
    "torch.softmax(dim=0) over the batch", "Tensor.var(dim=-1)", "Tensor.mean(dim=0) over the batch",
    "Tensor.sum() over all dims", "torch.cumsum(dim=-1)", "torch.cumsum(dim=0) over the batch",
    "torch.einsum('bth,bsh->bts') then 'bts,bsh->bth'", "torch.gather(dim=-1, per-row permutation)",
    "Tensor.scatter_add(dim=-1, per-row permutation)", "h[:, index tensor] (advanced indexing)",
    "Tensor.masked_fill(~keep, -inf) then softmax", "torch.where(mask, h, 0.1 * h)",
    "Tensor.reshape(B, 2, H // 2).transpose(1, 2).reshape(B, H)", "Tensor.flatten(1) of [B, T, H]",
    "Tensor.reshape merging batch rows (swap row pairs)", "torch.roll(1, dims=-1)", "torch.cat(dim=0) over the batch",
    "Tensor.split(H // 2, dim=-1) gated", "Tensor.prod(dim=-1)", "F.normalize(dim=-1)",
    "torch.topk(k=H // 2, dim=-1).values", "torch.sort(dim=0, descending=True).values over the batch",
)  # fmt: skip
FULL = os.environ.get("FSG_CORPUS") == "full"
CASES = [c.name for c in op_corpus.CASES] if FULL else list(CI_CASES)


@st.composite
def sizes_strategy(draw) -> tuple:
    """Sizes for one case: B divides over 2 and 4 ranks, H over the tensor-parallel axis."""
    return (
        draw(st.sampled_from([4, 8, 12])), draw(st.integers(2, 9)), draw(st.sampled_from([4, 8, 12])),
        draw(st.integers(2, 6)), draw(st.sampled_from([4, 6, 8])),
    )  # fmt: skip


# sizes for every case of the corpus (the CI run draws the same ones as a full run)
corpus_sizes = st.fixed_dictionaries({case.name: sizes_strategy() for case in op_corpus.CASES})


@settings(
    max_examples=int(os.environ.get("FSG_CORPUS_EXAMPLES", "1")), deadline=None,
    phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck),
)  # fmt: skip
@given(corpus_sizes)
def test_every_case_sharded_equals_unsharded_or_raises_a_clear_error(ranks, sizes):
    wanted = {name: sizes[name] for name in CASES}
    results = {world: ranks(world).run(corpus_workers.run_corpus, wanted)[0] for world in (2, 4)}
    table = corpus_table.merge(results)
    runs = [(name, preset, world, outcome) for world, by_case in results.items()
            for name, by_preset in by_case.items() for preset, outcome in by_preset.items()]  # fmt: skip
    silent = [r for r in runs if r[3].startswith("MISMATCH")]
    unclear = [r for r in runs if r[3].startswith("crash")]
    assert not silent, f"sharded != unsharded, silently: {silent}"
    assert not unclear, f"failures that are not a clear fsg error: {unclear}"
    matched = sum(r[3] == "match" for r in runs)
    assert matched >= 0.9 * len(runs), f"only {matched} of {len(runs)} runs match"
    if os.environ.get("FSG_CORPUS_UPDATE_DOCS") == "1":
        corpus_table.write_docs(table, full=FULL)
    if corpus_table.docs_torch_version() != corpus_table.torch_version():
        return  # which ops have rules moves between torch releases; the table is for CI's
    documented = corpus_table.read_docs()
    assert {name: table[name] for name in CASES} == {name: documented.get(name) for name in CASES}, (
        "the outcomes differ from the table in docs/sharding.md: regenerate it with "
        "FSG_CORPUS=full FSG_CORPUS_UPDATE_DOCS=1 python -m pytest tests/dist/test_op_corpus.py"
    )
