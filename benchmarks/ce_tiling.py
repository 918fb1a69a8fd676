"""The cross-entropy forward + backward kernel's tiling, and the fused loss's weight-gradient
sums, on one GPU: the sweep behind ``kernels/cross_entropy.py``'s warps and
``kernels/linear_cross_entropy.py``'s float32 accumulation.

    python benchmarks/ce_tiling.py            # GPT-2's chunk: 10672 x 50304 bf16 logits

Kernel rows: ``_ce_fwd_bwd_kernel`` (one program a row, two passes over it) at each warps x
columns-per-iteration; the same rows walked by 1-8 programs per SM (fewer rows in flight, so
the second pass may hit L2); and a one-pass variant holding the whole row in registers. Each
is checked against the float32 reference before it is timed (median of 10 calls, the logits
restored before each). Weight-gradient rows: two chunks' ``dlogits.T @ h`` summed as
float32 copies and an add (before), by GEMMs that write float32 and add into it
(``out_dtype``), and one GEMM over all the logits (the bound).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from fsg._src.kernels import cross_entropy as ce
from fsg._src.kernels.cross_entropy import _row_fwd_bwd, _row_loss


@triton.jit
def _persistent(x_ptr, stride, t_ptr, loss_ptr, drow_ptr, N, ignore_index, z_loss, V: tl.constexpr, BLOCK: tl.constexpr):
    for r in range(tl.program_id(0), N, tl.num_programs(0)):
        _row_fwd_bwd(x_ptr, stride, t_ptr, loss_ptr, drow_ptr, tl.cast(r, tl.int64), ignore_index, z_loss, V, BLOCK)


@triton.jit
def _one_pass(x_ptr, stride, t_ptr, loss_ptr, drow_ptr, ignore_index, z_loss, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    t = tl.load(t_ptr + row)
    c = tl.arange(0, BLOCK)
    x = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    e = tl.exp(x - m)
    s = tl.sum(e, axis=0)
    lse = m + tl.log(s)
    tl.store(loss_ptr + row, _row_loss(base, t, lse, ignore_index, z_loss, V))
    scale = tl.where(t != ignore_index, tl.load(drow_ptr + row), 0.0)
    g = (e / s * (1.0 + 2.0 * z_loss * lse) - tl.where(c == t, 1.0, 0.0)) * scale
    tl.store(base + c, g.to(x_ptr.dtype.element_ty), mask=c < V)


def median_ms(fn, reset=lambda: None) -> float:
    for _ in range(3):
        reset()
        fn()
    times = []
    for _ in range(10):
        reset()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10672)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tokens", type=int, default=16384, help="rows of the whole step (two chunks)")
    parser.add_argument("--dim", type=int, default=768)
    args = parser.parse_args()
    N, V = args.rows, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = (torch.randn(N, V, device="cuda", generator=g) * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    drow = torch.full((N,), 1.0 / args.tokens, device="cuda")
    x, loss = torch.empty_like(x0), torch.empty(N, device="cuda")
    ref_loss, ref_lse = ce.rows_reference(x0, t, -100, 0.0)
    ref_g = ce.grad_reference(x0, t, ref_lse, drow, -100, 0.0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; {N} x {V} bf16\n")
    print("| kernel | ms | GB/s (one read + one write) | matches the reference |\n|---|---|---|---|")

    def row(name, launch):
        x.copy_(x0)
        launch()
        torch.cuda.synchronize()
        ok = torch.allclose(loss, ref_loss, atol=1e-3, rtol=1e-4) and bool((x.float() - ref_g.float()).abs().max() < 1e-6)
        ms = median_ms(launch, lambda: x.copy_(x0))
        print(f"| {name} | {ms:.3f} | {2 * N * V * 2 / ms / 1e6:,.0f} | {ok} |", flush=True)

    common = (x, V, t, loss, drow)
    for warps in (4, 8, 16):
        for block in (2048, 4096, 8192):
            launch = lambda w=warps, b=block: ce._ce_fwd_bwd_kernel[(N,)](*common, -100, 0.0, V=V, BLOCK=b, num_warps=w)  # noqa: E731
            row(f"a program a row, {warps} warps, {block} columns", launch)
    for per_sm in (1, 2, 4, 8):
        for warps in (8, 16, 32):
            launch = lambda k=per_sm, w=warps: _persistent[(k * sms,)](*common, N, -100, 0.0, V=V, BLOCK=4096, num_warps=w)  # noqa: E731
            row(f"{per_sm} programs per SM walking the rows, {warps} warps", launch)
    block = triton.next_power_of_2(V)
    for warps in (16, 32):
        row(f"one pass, the row in registers, {warps} warps", lambda w=warps: _one_pass[(N,)](*common, -100, 0.0, V=V, BLOCK=block, num_warps=w))  # fmt: skip

    rest = args.tokens - N
    h = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, generator=g)
    d1 = torch.randn(N, V, device="cuda", dtype=torch.bfloat16, generator=g)
    d2 = torch.randn(rest, V, device="cuda", dtype=torch.bfloat16, generator=g)

    def copies_and_add():
        dw = (d1.T @ h[:N]).float()
        dw += (d2.T @ h[N:]).float()
        return dw.to(torch.bfloat16)

    def out_dtype():
        dw = torch.mm(d1.T, h[:N], out_dtype=torch.float32)
        return torch.addmm(dw, d2.T, h[N:], out_dtype=torch.float32, out=dw).to(torch.bfloat16)

    whole = torch.cat([d1, d2])
    print(f"\n| weight gradient over two chunks ({N} + {rest} rows) | ms |\n|---|---|")
    for name, fn in (("float32 copies + add", copies_and_add), ("GEMMs write float32 (out_dtype)", out_dtype),
                     ("one GEMM over all the logits (the bound)", lambda: whole.T @ h)):  # fmt: skip
        print(f"| {name} | {median_ms(fn):.3f} |", flush=True)


if __name__ == "__main__":
    main()
