"""GPT train step on several GPUs: fsg on a mesh beside DDP and FSDP2, one command per run.

    torchrun --nproc-per-node 2 benchmarks/dp.py --impl fsg                 # data parallel
    torchrun --nproc-per-node 2 benchmarks/dp.py --impl fsg-graph           # + CUDA-graph replay
    torchrun --nproc-per-node 2 benchmarks/dp.py --impl ddp                 # DDP, model + loss compiled
    torchrun --nproc-per-node 2 benchmarks/dp.py --impl ddp-opt             # + the optimizer step compiled
    torchrun --nproc-per-node 8 benchmarks/dp.py --impl fsg --sharding fsdp --model 1.3b
    torchrun --nproc-per-node 8 benchmarks/dp.py --impl fsdp2 --model 1.3b
    torchrun --nproc-per-node 4 benchmarks/dp.py --impl fsg --mesh dp=2,tp=2 --sharding fsdp_tp --model 355m
    torchrun --nproc-per-node 4 benchmarks/dp.py --impl fsg --mesh dp=2,tp=2 --sharding fsdp_tp --check
    torchrun --nproc-per-node 2 benchmarks/dp.py --impl fsg --check --share-gpu   # one GPU, gloo
    torchrun --nproc-per-node 4 benchmarks/dp.py --impl fsdp2 --mesh dp=2,tp=2 --model 355m
    torchrun --nproc-per-node 2 benchmarks/dp.py --impl fsg --sharding fsdp --fp8 tensorwise-gather --model 1.3b
    torchrun --nproc-per-node 2 benchmarks/dp.py --impl fsdp2 --fp8 tensorwise-gather --model 1.3b

Same step as benchmarks/gpt.py (GPT-2 shapes, bf16 compute, float32 params and AdamW), with
--batch sequences of --seq tokens per data-parallel rank. fsg: ``fsg.compile_step`` on
``fsg.Mesh(--mesh)`` (default ``dp=<world>``) with the ``--sharding`` preset; the batch is
sharded over ``dp``. ddp: nanoGPT's recipe, the strongest a user would write (issue 20):
``DDP(torch.compile(model + loss))``, the model's forward under autocast and the
cross-entropy on float32 logits inside the one compiled region, ``AdamW(fused=True)``;
ddp-opt: the same with the optimizer step compiled as gpt.py's compile-opt (a tensor lr,
``foreach``, ``capturable``, ``torch.compile(opt.step)``); ddp-opt-nomix: ddp-opt with
Inductor's mix-order reductions off (gpt.py's compile-opt-nomix, the fastest one-GPU baseline
on 2026-12-04); ddp-model: only the model compiled, the loss in eager float32 on the
materialized logits (the weaker baseline; RESULTS.md rows labelled ``ddp`` before the
H200 run of 2026-12-04 that added ``ddp-opt`` ran this). --reduce bfloat16 reduces gradients
in bf16 (fsg's ``Policy(reduce=...)``, DDP's ``bf16_compress_hook``, FSDP2's ``reduce_dtype``). fsdp2:
torchtitan's recipe (``benchmarks/tp_baseline.py``): with a ``tp`` axis in --mesh, Megatron
tensor parallelism of each block (the fused qkv split by heads), each block
``torch.compile``d, then ``fully_shard`` of each block and of the model over ``dp``
(``MixedPrecisionPolicy``: bf16 compute, --reduce gradient reduction), ``AdamW(foreach=True)``;
``--impl fsdp2 --mesh dp=2,tp=2 --check`` checks its tensor-parallel plan. --fp8: FP8 linear
layers (the output head in bf16). fsg: ``Policy(matmul=fsg.Float8(...))``, ``tensorwise``,
``tensorwise-gather`` (``all_gather="fp8"``: FSDP gathers the weights as FP8 bytes),
``rowwise``, ``rowwise-gw-fastgi`` (FP8 grad-weights, fast grad-input accumulation). ddp and
fsdp2: torchao's ``convert_to_float8_training`` before compiling (needs torchao),
``tensorwise``, or for fsdp2 ``tensorwise-gather``: torchtitan's FP8 FSDP2 recipe
(``enable_fsdp_float8_all_gather=True`` and ``precompute_float8_dynamic_scale_for_fsdp`` after
each optimizer step). With one process:
the one-GPU baselines. Rank 0 prints one JSON line: the mean device time per step over --steps
(CUDA events; after --warmup steps, a barrier and one more step), each step's time, global tokens/s, MFU, per-GPU peak memory, the first call's wall time and,
from a CUDA profile, the fraction of communication that ran beside compute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fsg  # noqa: E402
import fsg.sharding  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_baseline  # noqa: E402

MODELS = {"124m": (12, 12, 768), "355m": (24, 16, 1024), "1.3b": (24, 16, 2048), "tiny": (2, 4, 128)}
LR, B1, B2, WD, EPS = 6e-4, 0.9, 0.95, 0.1, 1e-8
PEAK_TFLOPS = 989.0  # H200 dense bf16
DDP_IMPLS = ("ddp", "ddp-opt", "ddp-opt-nomix", "ddp-model")
FP8 = {  # --fp8: fsg's configuration for each name
    "tensorwise": lambda: fsg.Float8(),
    "tensorwise-gather": lambda: fsg.Float8(all_gather="fp8"),
    "rowwise": lambda: fsg.Float8(recipe="rowwise"),
    "rowwise-gw-fastgi": lambda: fsg.Float8(recipe="rowwise", grad_weight="fp8", fast_accum=("forward", "grad_input")),
}
PRESETS = {
    "dp": lambda: fsg.sharding.data_parallel(),
    "fsdp": lambda: fsg.sharding.fsdp("dp"),
    "tp": lambda: fsg.sharding.tensor_parallel("tp"),
    "fsdp_tp": lambda: fsg.sharding.fsdp_tensor_parallel("dp", "tp"),
}


def _torchao_float8(model: torch.nn.Module, name: str) -> None:
    """torchao's float8 training on ``model``'s linear layers but its output head, as a user of
    torchao would: ``tensorwise``, or ``tensorwise-gather`` (FSDP2 gathers the weights in FP8)."""
    if name not in ("tensorwise", "tensorwise-gather"):
        raise SystemExit(f"--fp8 {name}: the torch baselines run torchao's tensorwise recipes only")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=name == "tensorwise-gather")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head")


class _WithLoss(torch.nn.Module):
    """The model and its loss as one module, so that ``torch.compile`` (and DDP) take both:
    the forward under autocast bf16, the cross-entropy on float32 logits (nanoGPT's layout)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            logits = self.model(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


def _mesh_axes(spec: str | None, world: int) -> dict[str, int]:
    if not spec:
        return {"dp": world}
    axes = {name: int(size) for name, size in (part.split("=") for part in spec.split(","))}
    if math.prod(axes.values()) != world:
        raise SystemExit(f"--mesh {spec} has {math.prod(axes.values())} devices, not {world}")
    return axes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["fsg", "fsg-graph", *DDP_IMPLS, "fsdp2"], required=True)
    parser.add_argument("--mesh", help="fsg's mesh, e.g. dp=2,tp=2 (default: dp=<world size>)")
    parser.add_argument("--sharding", choices=sorted(PRESETS), default="dp", help="fsg's sharding preset")
    parser.add_argument("--fp8", choices=sorted(FP8), help="FP8 linear layers (see above)")
    parser.add_argument("--model", choices=sorted(MODELS), default="124m")
    parser.add_argument("--batch", type=int, default=16, help="sequences per GPU")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", type=int, default=3, help="steps to profile for the overlap figure (0: none)")
    parser.add_argument("--trace", help="write rank 0's profile as a Chrome trace (.json.gz) here")
    parser.add_argument(
        "--check", action="store_true",
        help="instead of timing: fsg on the mesh == fsg on one device over 3 steps (float32 compute, "
        "fsg.testing.assert_sharded_matches_unsharded), e.g. the 2-D mesh on NCCL",
    )  # fmt: skip
    parser.add_argument(
        "--share-gpu", action="store_true",
        help="with --check: every rank on GPU 0, joined over gloo (a mesh's GPU code checked where one GPU is lent)",
    )  # fmt: skip
    parser.add_argument(
        "--loss", choices=["fused", "logits"], default="fused",
        help="fsg: the model's fused head+loss (linear_cross_entropy, which keeps its kernel on a "
        "mesh) or fsg.nn.cross_entropy on full logits (plain math on a mesh)",
    )  # fmt: skip
    parser.add_argument(
        "--reduce", choices=["float32", "bfloat16"], default="float32",
        help="the dtype gradients are reduced in: fsg.Policy(reduce=...), DDP's bf16_compress_hook, "
        "FSDP2's MixedPrecisionPolicy(reduce_dtype=...)",
    )  # fmt: skip
    parser.add_argument(
        "--bucket-mb", type=float, default=25.0,
        help="fsg: the gradient buckets' size cap in MB (compile_step(bucket_mb=...); the A/B of bucket sizes)",
    )  # fmt: skip
    parser.add_argument(
        "--no-update-on-arrival", action="store_true",
        help="fsg: one fused AdamW after every reduction (A/B of the per-bucket update pass)",
    )  # fmt: skip
    parser.add_argument(
        "--sm-carveout", type=int, default=0,
        help="keep this many SMs free of cuBLASLt matmuls (torch._C._set_sm_carveout_experimental, with "
        "cuBLASLt preferred) so that matmuls overlapping NCCL kernels do not run a second wave",
    )  # fmt: skip
    args = parser.parse_args()
    if args.fp8 == "tensorwise-gather" and args.impl in DDP_IMPLS:
        parser.error("--fp8 tensorwise-gather gathers FSDP's weights in FP8: use --impl fsdp2 or fsg --sharding fsdp")
    reduce_dtype = getattr(torch, args.reduce)
    if args.sm_carveout:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
    if args.no_update_on_arrival:
        from fsg._src.passes import update_on_arrival

        update_on_arrival.update_on_arrival = lambda gm: 1  # benchmark A/B only
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # fsg's per-stage timings
    if args.share_gpu and not (args.check and torch.cuda.is_available()):
        parser.error("--share-gpu runs --check on a GPU: give --check, on a machine with a GPU")
    if args.share_gpu:  # gloo moves CUDA tensors through the host: correct, not fast
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")
        rank, world, dev = dist.get_rank(), dist.get_world_size(), torch.device("cuda", 0)
    else:
        info = fsg.distributed.initialize(backend="gloo" if not torch.cuda.is_available() else None)
        rank, world, dev = info.rank, info.world_size, info.device  # world 1: the one-GPU baselines
    cuda = dev.type == "cuda"
    layers, heads, dim = MODELS[args.model]
    cfg = GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=layers, n_head=heads, n_embd=dim)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    axes = _mesh_axes(args.mesh, world) if args.impl.startswith("fsg") or args.impl == "fsdp2" else {"dp": world}
    dp = axes.get("dp", 1)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 50304, (args.batch * dp, args.seq + 1), generator=g) for _ in range(4)]

    if args.check and args.impl == "fsdp2":
        return check_baseline(model, axes, data, dev)
    if args.check:
        return check_equivalence(args, model, axes, data, dev)
    if args.impl.startswith("fsg"):
        mesh = fsg.Mesh(axes, device_type=dev.type) if world > 1 else None
        step = fsg.compile_step(
            (lambda params, batch: fsg.apply(model, params, batch["x"], batch["y"]))
            if args.loss == "fused"
            else (lambda params, batch: fsg.nn.cross_entropy(fsg.apply(model, params, batch["x"]), batch["y"])),
            mesh,
            optimizer=fsg.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD),
            precision=fsg.Policy(compute=torch.bfloat16, reduce=None if args.reduce == "float32" else reduce_dtype,
                                 matmul=FP8[args.fp8]() if args.fp8 else None),  # fmt: skip
            cuda_graph=True if args.impl == "fsg-graph" else None,
            bucket_mb=args.bucket_mb,
            param_sharding=PRESETS[args.sharding]() if mesh is not None else None,
            batch_sharding=fsg.P("dp") if "dp" in axes else fsg.P(),
        )
        state = [step.init(fsg.params(model))]
        for p in model.parameters():
            p.data = torch.empty(0, device=dev)
        batches = [{"x": d[:, :-1].to(dev), "y": d[:, 1:].to(dev)} for d in data]  # global; each rank keeps its rows

        def run(i):
            state[0], metrics = step(state[0], batches[i % 4])
            return metrics["loss"]

    else:
        if args.impl == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if world == 1:
                raise SystemExit("--impl fsdp2 needs several processes; the one-GPU baseline is --impl ddp")

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
            if args.fp8:
                _torchao_float8(model, args.fp8)
            ddp = tp_baseline.fsdp2_tp(model, _device_mesh(axes, dev), policy)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, foreach=True)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            if args.impl == "ddp-opt-nomix":  # as TORCHINDUCTOR_MIX_ORDER_REDUCTION=0
                import torch._inductor.config as inductor_config

                if not hasattr(inductor_config.triton, "mix_order_reduction"):
                    raise SystemExit(f"--impl ddp-opt-nomix: torch {torch.__version__} has no mix-order reductions")
                inductor_config.triton.mix_order_reduction = False
            if args.fp8:
                _torchao_float8(model, args.fp8)
            compiled = torch.compile(model if args.impl == "ddp-model" else _WithLoss(model))
            ddp = DDP(compiled, device_ids=[dev.index] if cuda else None) if world > 1 else compiled
            if world > 1 and args.reduce == "bfloat16":
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

                ddp.register_comm_hook(None, bf16_compress_hook)
            if args.impl.startswith("ddp-opt"):  # torch's recipe for a compiled optimizer, as gpt.py's compile-opt
                opt = torch.optim.AdamW(
                    model.parameters(), lr=torch.tensor(LR) if cuda else LR, betas=(B1, B2), eps=EPS,
                    weight_decay=WD, foreach=True, capturable=cuda,
                )  # fmt: skip
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=cuda)
        opt_step = torch.compile(opt.step) if args.impl.startswith("ddp-opt") else opt.step
        if args.fp8 == "tensorwise-gather":  # torchtitan: each weight's scale for the next FP8 gather, in one go
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            update = opt_step

            def opt_step():
                update()
                precompute_float8_dynamic_scale_for_fsdp(model)
        dp_rank = rank // (world // dp)  # torch's meshes are row-major: the tp ranks of a dp group share rows
        rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
        batches = [(d[rows, :-1].to(dev), d[rows, 1:].to(dev)) for d in data]

        def run(i):
            x, y = batches[i % 4]
            if args.impl in ("ddp-model", "fsdp2"):
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    logits = ddp(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            else:
                loss = ddp(x, y)
            loss.backward()
            opt_step()
            opt.zero_grad(set_to_none=True)
            return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    first = float(run(0))
    compile_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        run(i)
    sync()
    if dist.is_initialized():
        dist.barrier()
    # One more step before the clock starts: the ranks leave the barrier at different times, and
    # the first step after it absorbs that skew (5-7 ms on two H200s), which is not the steady
    # state. On CUDA the step time is the device's, from events recorded after each step (no
    # host sync in the loop): the mean over the steps, and each step's.
    run(args.warmup)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)] if cuda else []
    t0 = time.perf_counter()
    if marks:
        marks[0].record()
    for i in range(args.steps):
        loss = run(i)
        if marks:
            marks[i + 1].record()
    host_ms = (time.perf_counter() - t0) * 1e3 / args.steps  # the host's time to issue a step
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    per_step = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    if per_step:
        ms = sum(per_step) / len(per_step)
    trace = args.trace if rank == 0 else None
    overlap = overlapped_communication(run, args.profile, ms, trace) if args.profile and cuda else None
    if rank == 0:
        out = {
            "impl": args.impl,
            "loss": args.loss,
            "world": world,
            "mesh": axes,
            "sharding": args.sharding if args.impl.startswith("fsg") else args.impl,
            "reduce": args.reduce,
            "fp8": args.fp8,
            "update_on_arrival": not args.no_update_on_arrival,
            "bucket_mb": args.bucket_mb,
            "sm_carveout": args.sm_carveout,
            "nccl_max_ctas": os.environ.get("NCCL_MAX_CTAS"),
            "model": args.model,
            "ms": ms,
            "tokens_per_s": args.batch * dp * args.seq / ms * 1e3,
            "mfu": (6 * n_params + 12 * layers * args.seq * dim)
            * args.batch
            * dp
            * args.seq
            / (ms / 1e3)
            / (PEAK_TFLOPS * 1e12 * world),
            "peak_gib_per_gpu": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "host_ms_per_step": host_ms,
            # the device's time per step between events, in order, and their median
            "step_ms_each": [round(t, 2) for t in per_step],
            "step_ms_median": sorted(per_step)[len(per_step) // 2] if per_step else None,
            "compile_s": compile_s,
            "overlap": overlap,
            "first_loss": first,
            "last_loss": float(loss),
            "torch": torch.__version__,
        }
        print("RESULT " + json.dumps(out), flush=True)
    _shutdown()


def _shutdown(grace_s: float = 30.0) -> None:
    """Destroys the process group; exits anyway if that hangs (torch's NCCL teardown can hang
    after CUDA graphs captured NCCL kernels: pytorch/pytorch#115388)."""
    import threading

    def give_up():
        print(f"dp.py: process group teardown still hanging after {grace_s:.0f} s; exiting", flush=True)
        os._exit(0)

    timer = threading.Timer(grace_s, give_up)
    timer.daemon = True
    timer.start()
    fsg.distributed.shutdown()
    timer.cancel()


def _device_mesh(axes: dict[str, int], dev):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(dev.type, tuple(axes.values()), mesh_dim_names=tuple(axes))


def check_baseline(model, axes: dict, data: list, dev) -> None:
    """The FSDP2+TP baseline's tensor-parallel model against the unsharded one (raises on a
    mismatch): its head-aware split of the fused qkv projection is right."""
    mesh = _device_mesh(axes, dev)
    if "tp" not in mesh.mesh_dim_names:
        raise SystemExit("--impl fsdp2 --check checks the tensor-parallel plan: give --mesh with a tp axis")
    err = tp_baseline.check(model, mesh, data[0][:2, :-1].to(dev))
    if dist.get_rank() == 0:
        print(f"CHECK ok: the FSDP2+TP baseline's tensor-parallel GPT on {axes} equals the unsharded one "
              f"(max relative difference {err:.1e})", flush=True)  # fmt: skip
    _shutdown()


def check_equivalence(args, model, axes: dict, data: list, dev) -> None:
    """The sharded step against the unsharded one, batch by batch (raises on a mismatch).

    AdamW's ``eps`` is 1e-3 here, not 1e-8: Adam normalizes each gradient by its own size, so
    where the true gradient is ~0 (a key bias; rarely-hit weights) the two steps' summation-order
    noise (~1e-9) becomes a full-size update of either sign, and the check failed on 1 of 65,536
    elements on gloo (with or without fsg's passes). A larger ``eps`` leaves real gradients'
    updates Adam-like and noise-sized ones noise-sized."""
    import fsg.testing

    batches = [{"x": d[:, :-1].to(dev), "y": d[:, 1:].to(dev)} for d in data[:3]]
    fsg.testing.assert_sharded_matches_unsharded(
        lambda params, batch: fsg.apply(model, params, batch["x"], batch["y"]),
        fsg.params(model), batches, fsg.Mesh(axes, device_type=dev.type),
        optimizer=fsg.optim.adamw(LR, b1=B1, b2=B2, eps=1e-3, weight_decay=WD),
        param_sharding=PRESETS[args.sharding](), batch_sharding=fsg.P("dp") if "dp" in axes else fsg.P(),
        rtol=1e-4, atol=1e-5, backend="inductor",
    )  # fmt: skip
    if dist.get_rank() == 0:
        print(f"CHECK ok: {args.sharding} on {axes}, {args.model}, 3 steps equal to one device", flush=True)
    fsg.distributed.shutdown()


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlapped_communication(run, steps: int, step_ms: float, trace: str | None = None) -> dict:
    """Profiles ``steps`` steps (CUDA kernels only) and returns how much of the NCCL kernels'
    time ran while a compute kernel was running too: the fraction of communication hidden
    behind compute, as a trace viewer would show it."""
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.cuda.synchronize()
    # two unrecorded steps first: the profiler's start skews the ranks' first step. The device
    # finishes them before the recorded ones start (the host runs ahead of the device, which
    # otherwise puts the tail of earlier steps in the recording): exactly `steps` are recorded.
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=1, warmup=1, active=steps)) as prof:
        for i in range(steps + 2):
            run(i)
            if i == 1:
                torch.cuda.synchronize()
                if dist.is_initialized():
                    dist.barrier()
                torch.cuda.synchronize()
            prof.step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    comm, compute = [], []
    memsets = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        (comm if "nccl" in e.name.lower() else compute).append(span)
        memsets += "memset" in e.name.lower()
    everything = _union(comm + compute)
    window = (everything[0][0], everything[-1][1]) if everything else (0.0, 0.0)
    # when each collective of the first recorded step started (ms from its first kernel)
    comm_starts = [round((a - window[0]) / 1e3, 2) for a, _ in sorted(comm) if a - window[0] < step_ms * 1e3]
    busy = _union(compute)
    comm_us = sum(b - a for a, b in _union(comm))
    hidden = 0.0
    exposed = []  # the stretches of communication with no compute beside it
    for a, b in _union(comm):
        overlap = [(max(a, c), min(b, d)) for c, d in busy if min(b, d) > max(a, c)]
        hidden += sum(y - x for x, y in overlap)
        cursor = a
        for x, y in overlap:
            if x > cursor:
                exposed.append((cursor, x))
            cursor = max(cursor, y)
        if b > cursor:
            exposed.append((cursor, b))
    idle = (window[1] - window[0]) - sum(b - a for a, b in everything)
    gaps = [(b, c) for (_, b), (c, _) in zip(everything, everything[1:])]

    def longest(stretches):  # (start in ms from the first kernel, length in ms), longest first
        top = sorted(stretches, key=lambda ab: ab[0] - ab[1])[:6]
        return [(round((a - window[0]) / 1e3, 3), round((b - a) / 1e3, 3)) for a, b in top]

    return {
        "comm_ms_per_step": comm_us / 1e3 / steps,
        "hidden_fraction": hidden / comm_us if comm_us else None,
        "compute_ms_per_step": sum(b - a for a, b in busy) / 1e3 / steps,
        "exposed_ms_per_step": (comm_us - hidden) / 1e3 / steps,
        "idle_ms_per_step": idle / 1e3 / steps,  # no kernel at all (host, launch or sync gaps)
        "window_ms": (window[1] - window[0]) / 1e3,  # ~ steps * step time
        "steps_recorded": steps,
        "kernels_per_step": (len(comm) + len(compute)) / steps,
        "memsets_per_step": memsets / steps,
        "nccl_kernels_per_step": len(comm) / steps,
        "nccl_starts_ms": comm_starts,
        "longest_exposed": longest(exposed),
        "longest_idle": longest(gaps),
        "idle_gaps_over_50us": sum(1 for a, b in gaps if b - a > 50),
    }


if __name__ == "__main__":
    main()
