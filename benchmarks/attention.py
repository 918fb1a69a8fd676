"""Causal attention on one GPU: torch's SDPA backends side by side at the shapes fsg benchmarks.

    python benchmarks/attention.py

For each shape (batch B, query heads H, key-value heads Hkv, sequence T, head dim K; bf16,
``is_causal=True``) and each backend torch offers (flash, memory-efficient, cuDNN): the
forward and the forward + backward time (median of CUDA-event timings over fresh inputs,
after warm-up), the relative error of the output and the query gradient against the math
backend in float32, and which backend ``F.scaled_dot_product_attention`` picks by itself.
A backend that refuses the shape is listed as such.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: (B, H, Hkv, T, K)
    "GPT-2 124M, 16 x 1024": (16, 12, 12, 1024, 64),
    "GPT-2 355M, 16 x 1024": (16, 16, 16, 1024, 64),
    "GPT 1.3B, 16 x 1024": (16, 16, 16, 1024, 128),
    "HF GPT-2 124M, 8 x 1024": (8, 12, 12, 1024, 64),
    "HF Llama 150M (GQA 12/4), 8 x 1024": (8, 12, 4, 1024, 64),
}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def inputs(B, H, Hkv, T, K, dtype=torch.bfloat16):
    q = torch.randn(B, H, T, K, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, T, K, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, T, K, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v, torch.randn(B, H, T, K, device="cuda", dtype=dtype)


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def median_ms(fn, reps=20, sets=4, shape=None):
    data = [inputs(*shape) for _ in range(sets)]
    for i in range(3):
        fn(*data[i % sets])
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*data[i % sets])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    print("| shape | backend | forward (ms) | fwd + bwd (ms) | out rel. err | dq rel. err | default |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        q, k, v, g = inputs(*shape)
        with sdpa_kernel(SDPBackend.MATH):
            ref_q, ref_k, ref_v = (t.detach().float().requires_grad_() for t in (q, k, v))
            ref = attend(ref_q, ref_k, ref_v)
            ref.backward(g.float())
        try:
            default = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=shape[1] != shape[2])
            default = SDPBackend(default).name
        except Exception as e:  # noqa: BLE001 (a diagnostic column)
            default = f"? ({type(e).__name__})"
        for bname, backend in BACKENDS.items():
            try:
                with sdpa_kernel(backend):
                    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                    out = attend(qq, kk, vv)
                    out.backward(g)
                    err_o, err_q = rel(out, ref), rel(qq.grad, ref_q.grad)

                    def fwd(q, k, v, g):
                        with torch.no_grad():
                            attend(q, k, v)

                    def fwd_bwd(q, k, v, g):
                        attend(q, k, v).backward(g)

                    t_f = median_ms(fwd, shape=shape)
                    t_fb = median_ms(fwd_bwd, shape=shape)
            except RuntimeError as e:
                print(f"| {name} | {bname} | refused: {str(e).splitlines()[0][:80]} | | | | {default} |")
                continue
            print(f"| {name} | {bname} | {t_f:.3f} | {t_fb:.3f} | {err_o:.1e} | {err_q:.1e} | {default} |")


if __name__ == "__main__":
    main()
