"""Keyed, counter-based randomness: what stage 1 traces in place of torch's random ops.

Traced as is, a random op in the loss (``F.dropout``, ``torch.rand``, ``bernoulli``...)
draws from torch's global generator at every replay: not reproducible from ``state.rng``,
not resumable from a checkpoint, equal across a mesh's ranks only by luck. ``train_step``
traces the loss under ``keyed(rng)``, whose dispatch mode sits above ``make_fx``'s tracer:
the ops it calls in place of a random op are what the graph records, plain tensor math of

- the step's key ``state.rng = [seed, counter]``, read as tensors *in the graph* (traced
  once, replayed every step; the counter advances every step);
- the op's call index in the trace (a constant: microbatches and layers differ);
- the element's global (row-major) index, ``arange(numel)``.

Bits are splitmix64's finalizer over ``(i ^ key) * gamma`` in int64 tensor ops (multiplication
wraps). A uniform takes the top 24 bits for float32 (exact, in ``[0, 1)``), 53 for float64,
11 for float16, 8 for bfloat16; a normal is Box-Muller over two 24-bit uniforms of one word
(so float32 and float64 agree to rounding); a Python-float probability ``p`` is compared in
integers, ``bits < round(p * 2**24)``, whatever the dtype.

On a mesh the random tensor is computed whole from global indices (stage 2 replicates
tensors made inside the step): each rank holds the values the unsharded step draws. Other
random ops raise ``UnsupportedError`` naming the op and the user's line.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from fsg._src import _torch_private
from fsg._src.errors import UnsupportedError
from fsg._src.trace import purity

_aten = torch.ops.aten


def _signed(c: int) -> int:
    """``c`` mod 2**64 as an int64 (two's complement)."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)  # splitmix64's increment (odd: i -> i * gamma is a bijection)
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_SEED_SALT = _signed(0x5851F42D4C957F2D)
_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` (the shift is arithmetic). Not ``z >> s``: that is
    ``aten.__rshift__``, which DTensor (torch 2.13) takes for an in-place op, returning ``z``."""
    return torch.bitwise_right_shift(z, s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (a bijection of 64-bit words with full avalanche)."""
    z = (z ^ shr(z, 30)) * _M1
    z = (z ^ shr(z, 27)) * _M2
    return z ^ shr(z, 31)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` of ``dtype`` from 64-bit words: as many top bits as the dtype
    represents exactly, so none rounds up to 1."""
    bits = _BITS.get(dtype, 24)
    return shr(z, 64 - bits).to(dtype) * 2.0**-bits


def normal(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Standard normals (Box-Muller) from the top and the low 24 bits of each word."""
    u1 = shr(z, 40).to(compute_dtype(dtype)) * 2.0**-24
    u2 = (shr(z, 8) & 0xFFFFFF).to(compute_dtype(dtype)) * 2.0**-24
    return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


def first_accepted(ok: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Along the last dim, the first candidate whose ``ok`` is true (the first if none is):
    a rejection sampler's loop as a fixed number of keyed candidates."""
    first = torch.argmax(ok.to(torch.int8), dim=-1, keepdim=True)
    return torch.gather(candidates, -1, first).squeeze(-1)


def below(z: torch.Tensor, p: Any) -> torch.Tensor:
    """A bool tensor, True with probability ``p`` (a float or a tensor broadcast to ``z``)."""
    if not isinstance(p, torch.Tensor):
        return shr(z, 40) < round(min(max(p, 0.0), 1.0) * 2**24)
    return shr(z, 40).to(torch.promote_types(p.dtype, torch.float32)) * 2.0**-24 < p


# Higher-order operators whose bodies draw no random numbers (attention score and mask functions,
# user Triton kernels): ``Keyed`` lets them through. Any other is refused: a random op in its body
# would draw from torch's generator, not from the keys.
PASSED_HIGHER_ORDER_OPS = ("flex_attention", "flex_attention_backward", "triton_kernel_wrapper_functional",
                           "triton_kernel_wrapper_mutation")  # fmt: skip


class Keyed(_torch_private.TorchDispatchMode):
    """Rewrites random ops into keyed hashes of ``rng = [seed, counter]`` while tracing."""

    supports_higher_order_operators = True  # FlexAttention's and Triton's operators come here

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch runs a higher-order operator called eagerly (flex_attention) through a torch.compile
        # that skips a frame under any dispatch mode but those that say this; the operator it runs
        # still comes here. Any other torch.compile in a loss runs eagerly under the trace, as before.
        return _torch_private.in_hop_compile()

    def __init__(self, rng: torch.Tensor, offset: torch.Tensor | None = None):
        super().__init__()
        self._rng = rng
        self._offset = offset  # an int64 added to every call's key (a pipeline's microbatch)
        self._step_key: torch.Tensor | None = None
        self._saved: torch.Tensor | None = None
        self.calls = 0  # the random calls traced

    def __enter__(self):
        self._saved = torch.default_generator.get_state()
        torch.default_generator.manual_seed(0)  # the call counter (``bits``), restored at exit
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.default_generator.set_state(self._saved)

    def bits(self, shape: Any, device: Any) -> torch.Tensor:
        """A fresh stream: int64 words of ``shape``, element ``i`` a hash of (key, call, i). The
        call index is the seed of torch's CPU generator (set at ``__enter__``, restored at exit):
        ``torch.utils.checkpoint`` saves that generator's state before a checkpointed forward
        and restores it for the rerun in the backward, which so draws the forward's masks."""
        if self._step_key is None:  # once per graph, at the first random op (none: no nodes)
            seed, counter = self._rng[0], self._rng[1]
            self._step_key = _mix(_mix(seed ^ _SEED_SALT) + counter * _GAMMA)
            if self._offset is not None:
                self._step_key = self._step_key + self._offset
        # the n-th call after manual_seed(s) is s + n * gamma: n * gamma from the seed 0 set at entry;
        # a loss that seeds torch itself (Reformer) draws again what it drew after the same seed
        call = (torch.default_generator.initial_seed() + _GAMMA) % (1 << 64)
        torch.default_generator.manual_seed(call)
        self.calls += 1
        key = _mix(self._step_key + _signed(call))
        device = torch.device(device) if device is not None else self._rng.device
        key = key if key.device == device else key.to(device)
        index = torch.arange(math.prod(shape), dtype=torch.int64, device=device)
        # xor first: Inductor (2.11) folds ``arange * constant`` into an int32 index expression
        # (wrong values on CPU, a Triton compile error on CUDA; tests/test_random.py)
        return _mix((index ^ key) * _GAMMA).reshape(tuple(shape))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if isinstance(func, _torch_private.HigherOrderOperator):
            if func.name() in PASSED_HIGHER_ORDER_OPS:
                return func(*args, **kwargs)  # this mode is off while it runs: its bodies trace as usual
            where = purity.user_frame(traceback.extract_stack())
            raise UnsupportedError(
                f"the loss calls torch's higher-order operator {func.name()!r} at {where}; fsg traces only "
                f"{', '.join(PASSED_HIGHER_ORDER_OPS)} among them (a random op inside another's body would "
                f"not draw from state.rng). Write it as plain ops (torch.cond: torch.where of both branches)."
            )
        impl = _IMPLS.get(func)
        if impl is None:
            if _torch_private.draws_random(func) and not _deterministic_here(func, args, kwargs):
                raise unsupported(func, "it has no keyed version in fsg")
            return func(*args, **kwargs)
        names = _torch_private.arg_names(func)
        if "generator" in names[: len(args)]:  # positional in some schemas (poisson, binomial)
            at = names.index("generator")
            args, kwargs["generator"] = (*args[:at], *args[at + 1 :]), args[at]
        if kwargs.pop("generator", None) is not None:
            raise unsupported(func, "it was given an explicit generator=, which a replayed graph cannot follow")
        return impl(self, *args, **kwargs)


class _AttentionDropoutAsMath(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` with dropout runs its math (softmax, keyed dropout,
    matmul): the fused CUDA kernels draw their dropout inside, from torch's generator."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and (args[4] if len(args) > 4 else kwargs.get("dropout_p")):
            with sdpa_kernel([SDPBackend.MATH]):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def keyed(rng: torch.Tensor, offset: torch.Tensor | None = None) -> Iterator[Keyed]:
    """Traces the random ops called inside as keyed hashes of ``rng = [seed, counter]``.

    ``offset`` (int64, 0-d) is added to every call's index times splitmix's gamma: microbatch
    ``j`` of a step that draws ``K`` calls a microbatch, traced alone with ``offset = j * K *
    gamma`` (``call_offset``), draws what the unrolled step draws for it (a pipeline stage)."""
    with _AttentionDropoutAsMath(), Keyed(rng, offset) as mode:
        yield mode


def call_offset(microbatch: int, calls: int) -> int:
    """``keyed``'s ``offset`` for a microbatch of ``calls`` random calls: as an int64."""
    return _signed(microbatch * calls * _GAMMA)


def unsupported(func: Any, why: str) -> UnsupportedError:
    where = purity.user_frame(traceback.extract_stack())
    return UnsupportedError(
        f"the loss calls the random op {func} at {where}, and {why}. A compiled step draws its "
        f"random numbers from state.rng (reproducible from the seed, resumable from a checkpoint, "
        f"the same on a mesh as on one device), never from torch's global generator. Keyed ops: "
        f"{', '.join(n.removeprefix('aten.') for n in supported())}. Otherwise draw the values "
        f"outside the step and pass them in the batch."
    )


def _deterministic_here(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an op tagged random draws nothing with these arguments: attention or RNN
    kernels with ``dropout_p=0``, ``rrelu`` outside training (an omitted one is off)."""
    names = _torch_private.arg_names(func)
    named = {**dict(zip(names, args)), **kwargs}
    if any(n in names and not named.get(n, False) for n in ("train", "training")):
        return True
    gates = [n for n in ("dropout_p", "dropout") if n in names]
    return bool(gates) and all(not float(named.get(n, 0.0)) for n in gates)


# The rewrites, by op (``random_ops.py`` registers them). Each gets the mode (``keys.bits``)
# and the op's arguments, with the keyword-only ``generator`` taken out.

_IMPLS: dict[Any, Callable[..., Any]] = {}


def rewrite(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers ``fn`` for the aten overloads ``names`` (``"rand.default"``) this torch has."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            packet, overload = name.split(".")
            op = getattr(getattr(_aten, packet), overload, None)
            if op is not None:
                _IMPLS[op] = fn
        return fn

    return register


def supported() -> tuple[str, ...]:
    """The aten ops with a keyed version."""
    return tuple(sorted({_torch_private.op_name(op) for op in _IMPLS}))


from fsg._src.trace import random_counts, random_ops  # noqa: E402, F401 - register the rewrites (they import this module)
