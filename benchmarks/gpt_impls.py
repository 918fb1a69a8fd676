"""The implementations ``benchmarks/gpt.py --impl`` times: a registry of base names and the
suffixes that vary them, so that a name the script does not know is an error, not a row timed
under the wrong label.

A name is a base, then at most one suffix of each group of ``SUFFIXES`` in that order (e.g.
``fsg-fp8-row-gw-fastgi-catgrads-noln``). Each suffix applies to the bases its ``applies``
names (by prefix). ``resolve(name)`` returns what the name asks for; ``impl_list`` is the
argparse ``type=`` of ``--impl``.

Removed, measured slower (figures in benchmarks/RESULTS.md): ``fsg-biasfuse``, the
``-colamax`` / ``-nocolamax`` rows, ``-lnb`` / ``-nolnb`` and ``-s3``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from _common import FAST_ACCUM

# base name -> (what it is, the Fusions fields it changes)
BASES: dict[str, tuple[str, dict]] = {
    "eager": ("PyTorch modules, autocast, torch.optim.AdamW(fused=True)", {}),
    "compile": (
        "torch.compile of (ids, targets) -> loss: the model and the loss (on float32 logits) in one compiled "
        "region, as nanoGPT and torchtitan do; autocast, fused AdamW. The baseline",
        {},
    ),
    "compile-max": ('compile with mode="max-autotune-no-cudagraphs" (minutes of autotuning)', {}),
    "compile-opt": (
        "compile, plus the optimizer step under torch.compile (AdamW(foreach=True), lr as a tensor)",
        {},
    ),
    "compile-opt-nomix": (
        "compile-opt with Inductor's mix-order reductions off (TORCHINDUCTOR_MIX_ORDER_REDUCTION=0), a variant "
        "the baseline search must include",
        {},
    ),
    "compile-fp8": (
        "compile after torchao's convert_to_float8_training (tensorwise dynamic scaling, the head kept in bf16): "
        "the layer-by-layer FP8 baseline (needs torchao)",
        {},
    ),
    "compile-fp8-row": ("compile-fp8 with torchao's rowwise recipe", {}),
    "compile-model": ("torch.compile(model) with the loss outside, in eager float32 (the weaker baseline)", {}),
    "compile-muon": (
        "compile with torch.optim.Muon (lr 0.02) for the blocks' weight matrices and AdamW for the rest",
        {},
    ),
    "compile-opt-muon": ("compile-muon with both optimizer steps under torch.compile", {}),
    "jax": ("jax.jit of value_and_grad + optax.adamw, donated state, layers under lax.scan", {}),
    "fsg": (
        "fsg.compile_step with every default on: fused AdamW, CUDA-graph replay, the loss through "
        "fsg.nn.linear_cross_entropy",
        {},
    ),
    "fsg-autocast": ("fsg with Policy(compute=bf16, autocast=True): the baseline's numerics op for op", {}),
    "fsg-logits": ("fsg with the loss on full logits (fsg.nn.cross_entropy)", {}),
    "fsg-nograph": ("fsg without CUDA-graph replay", {}),
    "fsg-nofuse": ("fsg with the traced optimizer, not the fused AdamW kernel", {}),
    "fsg-noepilogue": (
        "fsg with Fusions(gemm_epilogues=False): the MLP's GELU and its gradient left to Inductor",
        {"gemm_epilogues": False},
    ),
    "fsg-epilogue-fwd": (
        "fsg with only the epilogues' forward half (Fusions(gemm_epilogue_backward=False))",
        {"gemm_epilogue_backward": False},
    ),
    "fsg-atensums": (
        "fsg with Fusions(column_sums=False): Inductor's mix-order reductions end in torch's sum",
        {"column_sums": False},
    ),
    "fsg-eachcast": (
        "fsg with Fusions(batch_casts=False): each parameter cast to bf16 by a kernel of its own",
        {"batch_casts": False},
    ),
    "fsg-muon": ("fsg with fsg.optim.multi_transform: muon(0.02) for the blocks' matrices, adamw for the rest", {}),
    "fsg-skip": ("fsg with skip_nonfinite=True: the cost of skipping non-finite steps in the graph", {}),
    "fsg-fp8": ("fsg with Policy(matmul=fsg.Float8()): tensorwise-scaled FP8 matmuls (Hopper and Ada)", {}),
    "fsg-fp8-row": ('fsg-fp8 with Float8(recipe="rowwise"): a scale per row, the grad-weight in bf16', {}),
    "fsg-fp8-row-unfused": (
        "fsg-fp8-row with Fusions(fp8_producers=set()): no producer computes its output's cast",
        {"fp8_producers": frozenset()},
    ),
    "fsg-fp8-row-gelubwd": (
        "fsg-fp8-row with only the GELU gradient's cast fused into its producer",
        {"fp8_producers": frozenset({"gelu_backward"})},
    ),
    "fsg-fp8-row-nocolsum": (
        "fsg-fp8-row with Fusions(fp8_column_sums=False): a bias gradient's operand cast by Inductor",
        {"fp8_column_sums": False},
    ),
    "fsg-fp8-row-gw": ('fsg-fp8-row with Float8(grad_weight="fp8"): the grad-weights in FP8 too', {}),
    "fsg-fp8-row-gw-nocolsum": ("fsg-fp8-row-gw with Fusions(fp8_column_sums=False)", {"fp8_column_sums": False}),
}
# the Float8 configuration of each FP8 base
FLOAT8 = {
    "fsg-fp8": {},
    **{name: {"recipe": "rowwise"} for name in BASES if name.startswith("fsg-fp8-row")},
    **{name: {"recipe": "rowwise", "grad_weight": "fp8"} for name in BASES if name.startswith("fsg-fp8-row-gw")},
}


@dataclass(frozen=True)
class Suffix:
    """A suffix: the bases it applies to (by prefix), what it does, and its changes."""

    applies: str
    help: str
    fusions: dict = field(default_factory=dict)
    float8: dict = field(default_factory=dict)


# the groups, in the order they follow the base; at most one suffix of each
SUFFIXES: list[dict[str, Suffix]] = [
    {
        "-fastgi": Suffix("fsg-fp8", "the grad-inputs accumulate in the fast accumulator too", float8={"fast_accum": FAST_ACCUM["-fastgi"]}),
        "-fastall": Suffix("fsg-fp8", "the grad-weights too", float8={"fast_accum": FAST_ACCUM["-fastall"]}),
    },
    {"-catgrads": Suffix("fsg", "Fusions(pack_attention_grads=False)", {"pack_attention_grads": False})},
    {
        "-ln": Suffix("fsg-fp8-row", "the default (the layer norms' casts fused): older rows' name"),
        "-noln": Suffix("fsg-fp8-row", "Fusions(fp8_layer_norms=False)", {"fp8_layer_norms": False}),
    },
    {
        "-wfp8": Suffix("fsg-fp8-row", "the default (a weight's two casts in one op)"),
        "-nowfp8": Suffix("fsg-fp8-row", "Fusions(fp8_weights=False)", {"fp8_weights": False}),
    },
    {"-bf16proj": Suffix("fsg-fp8", "the attention's output projections kept in bf16 (Float8(filter=...))")},
    {"-auto": Suffix("fsg-fp8", 'Float8(filter="auto"): the cost model picks the layers on this GPU')},
]  # fmt: skip
# no base ends in a suffix, so a name's suffixes are read off its end
assert not any(base.endswith(s) for base in BASES for group in SUFFIXES for s in group)


@dataclass(frozen=True)
class Impl:
    """What an implementation name asks for."""

    name: str
    base: str
    suffixes: tuple[str, ...]
    fusions: dict  # Fusions(**fusions)
    float8: dict | None  # fsg.Float8(**float8) for an FP8 base, else None

    def has(self, suffix: str) -> bool:
        return suffix in self.suffixes


def resolve(name: str) -> Impl:
    """The implementation ``name`` names; raises ``ValueError`` listing the valid names for one
    it does not know."""
    rest, found = name, []
    for group in reversed(SUFFIXES):  # the last group is the outermost suffix
        suffix = next((s for s in group if rest.endswith(s)), None)
        if suffix is not None:
            found.insert(0, suffix)
            rest = rest[: -len(suffix)]
    if rest not in BASES:
        raise ValueError(f"unknown implementation {name!r}: {_valid()}")
    fusions, float8 = dict(BASES[rest][1]), (dict(FLOAT8[rest]) if rest in FLOAT8 else None)
    for suffix in found:
        spec = next(group[suffix] for group in SUFFIXES if suffix in group)
        if not rest.startswith(spec.applies):
            raise ValueError(
                f"{name!r}: the suffix {suffix} applies to {spec.applies}* implementations only, not {rest}"
            )
        fusions.update(spec.fusions)
        if float8 is not None:
            float8.update(spec.float8)
    return Impl(name, rest, tuple(found), fusions, float8)


def _valid() -> str:
    groups = " ".join("[" + "|".join(group) + "]" for group in SUFFIXES)
    return f"a base ({', '.join(BASES)}) then, in this order, at most one suffix of each group {groups}"


def impl_list(value: str) -> list[Impl]:
    """``--impl``'s argparse type: comma-separated names, each ``resolve``d."""
    try:
        return [resolve(name) for name in value.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def describe() -> str:
    """The names and suffixes, for ``--help``."""
    lines = [f"  {name:<24} {what}" for name, (what, _) in BASES.items()]
    for group in SUFFIXES:
        lines += [f"  + {suffix:<22} ({spec.applies}*) {spec.help}" for suffix, spec in group.items()]
    return "\n".join(lines)
