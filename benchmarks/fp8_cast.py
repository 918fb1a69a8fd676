"""The fused rowwise FP8 cast kernels (``fsg/_src/kernels/fp8/cast.py``) beside Inductor's
code for the same unfused ops, and a sweep of their tilings, in one run on one GPU.

    python benchmarks/fp8_cast.py                # 355M and 1.3B shapes, markdown to stdout
    python benchmarks/fp8_cast.py --sweep        # also every tiling of the sweep

Each case is one tensor of a GPT-2 step at batch 16 x 1024 (M = 16,384 token rows) under
``Float8(recipe="rowwise")``: the MLP's GELU gradient (``gelu_backward_fp8``), its activation
(``gelu_fp8``), the qkv gradient ``cat([dq, dk, dv])`` whose pieces come out of attention's
backward as transposed heads (``cat_rowwise_fp8``), a residual-stream gradient
(``rowwise_fp8``), a layer norm's output (``layer_norm_fp8``: the norm and its cast), and a
weight's two casts from its float32 master (``weight_fp8``: ``W`` and ``W.T``, each a scale per
row). "Inductor" is ``torch.compile`` of the reference (the ops the float8 pass emits when
nothing is fused; for a weight, the bf16 copy then Inductor's two casts of it, each compiled
alone, as the step runs them, one in the forward and one in the backward).
``--only weight --sweep`` times the weight kernels' tiles alone. GB/s counts the bytes each must move (inputs read once, outputs
written once), against a device-to-device copy of 1 GiB in the same run. Times are medians of
``triton.testing.do_bench`` (CUDA events).
"""

from __future__ import annotations

import argparse
import itertools
import platform

import torch
import triton
from triton.testing import do_bench

from fsg._src.kernels._common import RowTiling
from fsg._src.kernels.fp8 import cast as K
from fsg._src.kernels.fp8 import layer_norm as LN
from fsg._src.kernels.fp8 import weight as WF

M = 16384
# the sweep's tilings: rows a tile, programs (0: one a tile, no loop), warps, software-pipeline
# stages of the row loop; the 355M sweep (RESULTS.md, H200, 2026-12-02) found one row a tile best
# everywhere, by 1.5-10x
SWEEP = ((1,), (1024, 2048), (8, 16), (1, 2, 3))
WIDE = ((1, 2), (512, 1024, 2048, 4096, 0), (4, 8, 16, 32), (1, 2))  # --wide: for the 1.3B widths
WEIGHT_SWEEP = ((32, 64, 128), (32, 64, 128), (4, 8))  # the weight kernels' tile rows, columns, warps


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _cases(widths: dict[str, int]):
    """``(name, fused op, reference, inputs, bytes moved, launch(t) or None)`` per case."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device="cuda") * scale).bfloat16()

    for model, C in widths.items():
        H = 4 * C
        dy, h = randn(M, H, scale=1e-3), randn(M, H, scale=2)
        heads = C // 64
        # attention's gradients: [B, T, H, D] in memory (q's layout), read as [B, T, C] rows
        pieces = [randn(16, 1024, heads, 64).view(16, 1024, C) for _ in range(3)]
        x = randn(M, C)
        f8, f32 = 1, 4
        yield (f"{model} GELU gradient [{M}, {H}]", K.gelu_backward_fp8, K.gelu_backward_fp8_reference,
               (dy, h, "tanh"), M * H * (2 + 2 + 2 + f8), "gelu_backward:tanh")  # fmt: skip
        yield (f"{model} GELU activation [{M}, {H}]", K.gelu_fp8, K.gelu_fp8_reference,
               (h, "tanh"), M * H * (2 + 2 + f8), "gelu:tanh")  # fmt: skip
        yield (f"{model} qkv gradient cat 3 x [{M}, {C}]", K.cat_rowwise_fp8, K.cat_rowwise_fp8_reference,
               (pieces,), M * 3 * C * (2 + 2 + f8), "cat")  # fmt: skip
        yield (f"{model} residual gradient [{M}, {C}]", K.rowwise_fp8, K.rowwise_fp8_reference,
               (x,), M * C * (2 + f8) + M * f32, "identity")  # fmt: skip
        w, b = randn(C, scale=0.5) + 1, randn(C, scale=0.1)
        yield (f"{model} layer norm [{M}, {C}]: y, its FP8 copy, statistics", LN.layer_norm_fp8,
               LN.layer_norm_fp8_reference, (x, w, b, 1e-5), M * C * (2 + 2 + f8) + 3 * M * f32, "layer_norm")  # fmt: skip
        r = randn(M, C)
        yield (f"{model} layer norm of x + r [{M}, {C}]: the sum, y, its FP8 copy, statistics", LN.add_layer_norm_fp8,
               _add_layer_norm_reference, (x, r, w, b, 1e-5), M * C * (2 + 2 + 2 + 2 + f8) + 3 * M * f32,
               "add_layer_norm")  # fmt: skip
        for rows, cols in ((3 * C, C), (4 * C, C), (C, 4 * C)):  # qkv's, fc's, fc_proj's weights
            w = torch.randn(rows, cols, generator=gen, device="cuda") * 0.02
            yield (f"{model} weight [{rows}, {cols}] float32: both FP8 casts", WF.weight_fp8, _weight_today,
                   (w, torch.bfloat16), rows * cols * (f32 + 2 * f8), "weight")  # fmt: skip


def _cast_rows(g):
    return K.rowwise_fp8_reference(g)[:2]


_CASTS = {}


def _weight_today(w, round_to):
    """What the step runs without ``Fusions.fp8_weights``: the compute-dtype copy (``cast_flat``'s
    write), then Inductor's cast of it in the forward and of its transpose in the backward
    (compiled apart: they run far apart in the step)."""
    if not _CASTS:
        _CASTS["rows"], _CASTS["cols"] = torch.compile(_cast_rows), torch.compile(lambda g: _cast_rows(g.t()))
    w16 = w.to(round_to)
    return (*_CASTS["rows"](w16), *_CASTS["cols"](w16))


_weight_today.compiled = True  # main() times it as it is


def _add_layer_norm_reference(x, r, w, b, eps):
    s = x + r
    return (s, *LN.layer_norm_fp8_reference(s, w, b, eps))


def _launcher(kind: str, args, t: RowTiling):
    """A launch of the kernel alone with tiling ``t`` (outputs allocated once)."""
    if kind in ("layer_norm", "add_layer_norm"):
        x, r, w, b, eps = args if kind == "add_layer_norm" else (args[0], None, *args[1:])
        f32 = {"dtype": torch.float32, "device": "cuda"}
        outs = (torch.empty_like(x), torch.empty(x.shape[0], **f32), torch.empty(x.shape[0], **f32),
                torch.empty(x.shape, dtype=K.E4M3, device="cuda"), torch.empty((x.shape[0], 1), **f32))  # fmt: skip
        s = None if r is None else torch.empty_like(x)
        return lambda: LN.launch(x, w, b, *outs, eps, t, r_MN=r, s_MN=s)
    if kind == "cat":
        xs = [K._rows_of(p) for p in args[0]]
        producer, h = "identity", None
    elif kind.startswith("gelu_backward"):
        xs, h, producer = [args[0]], args[1], kind
    else:
        xs, h, producer = [args[0]], None, kind
    M_, C = xs[0].shape
    N = C * len(xs)
    colsum = not kind.startswith("gelu:")
    q = torch.empty((M_, N), dtype=K.E4M3, device="cuda")
    inv = torch.empty((M_, 1), dtype=torch.float32, device="cuda")
    part = torch.empty((t.programs, N), dtype=torch.float32, device="cuda") if colsum else None
    g = None if kind == "identity" else torch.empty((M_, N), dtype=torch.bfloat16, device="cuda")

    def run():
        K.launch(xs, h, g, q, inv, part, producer, t)
        if part is not None:
            part.sum(0)

    return run


def _weight_sweep(name, w, moved, t_ind, copy_gbs) -> None:
    """The weight kernels' tiles and warps (``WEIGHT_SWEEP``), amax zeroing and both launches timed."""
    N, K_ = w.shape
    outs = (torch.empty((N, K_), dtype=K.E4M3, device="cuda"), torch.empty((N, 1), device="cuda"),
            torch.empty((K_, N), dtype=K.E4M3, device="cuda"), torch.empty((K_, 1), device="cuda"))  # fmt: skip
    amax = torch.empty(N + K_, device="cuda")
    best, warps_default = None, WF.NUM_WARPS
    for bn, bk, warps in itertools.product(*WEIGHT_SWEEP):
        WF.NUM_WARPS = warps

        def run():
            amax.zero_()
            WF.launch(w, torch.bfloat16, amax, *outs, block=(bn, bk))

        try:
            ms = _ms(run)
        finally:
            WF.NUM_WARPS = warps_default
        gbs = moved / ms / 1e6
        print(f"| {name} | block {bn} x {bk}, warps={warps} | {ms:.3f} | {gbs:.0f} | {gbs / copy_gbs:.0%} | "
              f"{t_ind / ms:.2f}x |", flush=True)  # fmt: skip
        label = f"block {bn} x {bk}, warps={warps}"
        best = min(best, (ms, label)) if best else (ms, label)
    print(f"| {name} | **best of the sweep**: {best[1]} | {best[0]:.3f} |  |  | {t_ind / best[0]:.2f}x |", flush=True)


def _copy_gbs() -> float:
    src = torch.empty(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _ms(lambda: dst.copy_(src)) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time every tiling of the sweep")
    parser.add_argument("--models", default="355M,1.3B", help="which models' widths: 355M (1024), 1.3B (2048)")
    parser.add_argument("--wide", action="store_true", help="the sweep over 1-2 rows a tile, 512-4096 programs, 4-32 warps")
    parser.add_argument("--only", default="", help="only the cases whose name contains this (e.g. 'backward')")
    args = parser.parse_args()
    copy_gbs = _copy_gbs()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)\n")
    print("| case | implementation | ms | GB/s | of copy | vs Inductor |")
    print("|---|---|---|---|---|---|")
    for name, op, ref, inputs, moved, kind in _cases(
        {m: {"355M": 1024, "1.3B": 2048}[m] for m in args.models.split(",")}
    ):
        if args.only not in name:
            continue
        compiled = ref if getattr(ref, "compiled", False) else torch.compile(ref)
        t_ind = _ms(lambda: compiled(*inputs))
        t_op = _ms(lambda: op(*inputs))
        for label, t in (("Inductor (unfused ops, compiled)", t_ind), ("fsg fused op (default tiling)", t_op)):
            gbs = moved / t / 1e6
            print(f"| {name} | {label} | {t:.3f} | {gbs:.0f} | {gbs / copy_gbs:.0%} | {t_ind / t:.2f}x |", flush=True)
        if not args.sweep:
            continue
        if kind == "weight":
            _weight_sweep(name, inputs[0], moved, t_ind, copy_gbs)
            continue
        xs0 = inputs[0][0] if kind == "cat" else inputs[0]
        C = xs0.shape[-1]
        pieces = 3 if kind == "cat" else 1
        colsum = not kind.startswith(("gelu:", "layer_norm", "add_layer_norm"))
        best = None
        grid = WIDE if args.wide else SWEEP
        for rows, programs, warps, stages in itertools.product(*grid):
            if rows * pieces * triton.next_power_of_2(C) > 16384 or (programs == 0 and colsum and M // rows > 4096):
                continue
            iters = 1 if programs == 0 else max(1, -(-M // (rows * programs)))
            t = RowTiling(M, C, rows=rows, iters=iters, num_warps=warps, stages=stages)
            try:
                ms = _ms(_launcher(kind, inputs, t))
            except Exception as exc:  # a tiling the compiler refuses (resources): skip it
                print(
                    f"| {name} | rows={rows} programs={t.programs} warps={warps} stages={stages} | failed: "
                    f"{type(exc).__name__} |  |  |  |"
                )
                continue
            gbs = moved / ms / 1e6
            tiling = f"rows={rows} iters={iters} programs={t.programs} warps={warps} stages={stages}"
            print(f"| {name} | {tiling} | {ms:.3f} | {gbs:.0f} | {gbs / copy_gbs:.0%} | {t_ind / ms:.2f}x |", flush=True)
            best = min(best, (ms, tiling)) if best else (ms, tiling)
        print(
            f"| {name} | **best of the sweep**: {best[1]} | {best[0]:.3f} |  |  | {t_ind / best[0]:.2f}x |", flush=True
        )
    # correctness beside the reference, on the timed shapes
    for name, op, ref, inputs, _, _ in _cases({"355M": 1024}):
        if args.only not in name:
            continue
        out, want = op(*inputs), ref(*inputs)
        if op is WF.weight_fp8:  # both copies: of W's rows (rounded to bf16), of W.T's
            rows = inputs[0].bfloat16().float()
            checks = [(out[0], out[1], want[1], rows), (out[2], out[3], want[3], rows.t())]
        else:  # where the FP8 copy is among the outputs, and which tensor's rows it casts (None: the input)
            cases = {K.rowwise_fp8: (0, None), LN.layer_norm_fp8: (3, 0), LN.add_layer_norm_fp8: (4, 1)}
            first, cast_of = cases.get(op, (1, 0))
            q = out[first]
            rows = (inputs[0] if cast_of is None else out[cast_of]).reshape(q.shape).float()
            checks = [(q, out[first + 1], want[first + 1], rows)]
        for q, inv, inv_ref, rows in checks:
            differ = int((q != (rows / inv).clamp(-448, 448).to(K.E4M3)).sum())  # rows * scale vs rows / (1 / scale)
            err = float(((inv - inv_ref).abs() / inv_ref.abs()).max())
            print(
                f"\n{name}: FP8 bytes that differ from its own rows / its inverse scales: {differ} of {q.numel()}; "
                f"scales vs the reference's: max rel. difference {err:.1e}"
            )


if __name__ == "__main__":
    main()
