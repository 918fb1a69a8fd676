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


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` (the shift is arithmetic). Not ``z >> s``: that is
    ``aten.__rshift__``, which DTensor (torch 2.13) takes for an in-place op, returning ``z``."""
    return torch.bitwise_right_shift(z, s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (a bijection of 64-bit words with full avalanche)."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` of ``dtype`` from 64-bit words: as many top bits as the dtype
    represents exactly, so none rounds up to 1."""
    bits = _BITS.get(dtype, 24)
    return _shr(z, 64 - bits).to(dtype) * 2.0**-bits


def normal(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Standard normals (Box-Muller) from the top and the low 24 bits of each word."""
    u1 = _shr(z, 40).to(_compute(dtype)) * 2.0**-24
    u2 = (_shr(z, 8) & 0xFFFFFF).to(_compute(dtype)) * 2.0**-24
    return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


def below(z: torch.Tensor, p: Any) -> torch.Tensor:
    """A bool tensor, True with probability ``p`` (a float or a tensor broadcast to ``z``)."""
    if not isinstance(p, torch.Tensor):
        return _shr(z, 40) < round(min(max(p, 0.0), 1.0) * 2**24)
    return _shr(z, 40).to(torch.promote_types(p.dtype, torch.float32)) * 2.0**-24 < p


class Keyed(_torch_private.TorchDispatchMode):
    """Rewrites random ops into keyed hashes of ``rng = [seed, counter]`` while tracing."""

    def __init__(self, rng: torch.Tensor):
        super().__init__()
        self._rng = rng
        self._step_key: torch.Tensor | None = None
        self._calls = 0

    def bits(self, shape: Any, device: Any) -> torch.Tensor:
        """A fresh stream: int64 words of ``shape``, element ``i`` a hash of (key, call, i)."""
        if self._step_key is None:  # once per graph, at the first random op (none: no nodes)
            seed, counter = self._rng[0], self._rng[1]
            self._step_key = _mix(_mix(seed ^ _SEED_SALT) + counter * _GAMMA)
        self._calls += 1
        key = _mix(self._step_key + _signed(self._calls * _GAMMA))
        device = torch.device(device) if device is not None else self._rng.device
        key = key if key.device == device else key.to(device)
        index = torch.arange(math.prod(shape), dtype=torch.int64, device=device)
        # xor first: Inductor (2.11) folds ``arange * constant`` into an int32 index expression
        # (wrong values on CPU, a Triton compile error on CUDA; tests/test_random.py)
        return _mix((index ^ key) * _GAMMA).reshape(tuple(shape))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        impl = _IMPLS.get(func)
        if impl is None:
            if _torch_private.draws_random(func) and not _deterministic_here(func, args, kwargs):
                raise _unsupported(func, "it has no keyed version in fsg")
            return func(*args, **kwargs)
        if kwargs.pop("generator", None) is not None:
            raise _unsupported(func, "it was given an explicit generator=, which a replayed graph cannot follow")
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
def keyed(rng: torch.Tensor) -> Iterator[None]:
    """Traces the random ops called inside as keyed hashes of ``rng = [seed, counter]``."""
    with _AttentionDropoutAsMath(), Keyed(rng):
        yield


def _unsupported(func: Any, why: str) -> UnsupportedError:
    where = purity.user_frame(traceback.extract_stack())
    return UnsupportedError(
        f"the loss calls the random op {func} at {where}, and {why}. A compiled step draws its "
        f"random numbers from state.rng (reproducible from the seed, resumable from a checkpoint, "
        f"the same on a mesh as on one device), never from torch's global generator. Keyed ops: "
        f"{', '.join(n.removeprefix('aten.') for n in SUPPORTED)}. Otherwise draw the values "
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


# The rewrites, by op. Each gets the mode (``keys.bits``) and the op's arguments, with the
# keyword-only ``generator`` taken out.

_IMPLS: dict[Any, Callable[..., Any]] = {}


def _rewrite(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers ``fn`` for the aten overloads ``names`` (``"rand.default"``) this torch has."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            packet, overload = name.split(".")
            op = getattr(getattr(_aten, packet), overload, None)
            if op is not None:
                _IMPLS[op] = fn
        return fn

    return register


def _dtype(kw: dict, like: Any = None, default: Any = None) -> torch.dtype:
    if kw.get("dtype") is not None:
        return kw["dtype"]
    return like.dtype if like is not None else (default or torch.get_default_dtype())


def _device(kw: dict, like: Any = None) -> Any:
    return kw["device"] if kw.get("device") is not None else (like.device if like is not None else None)


def _integers(z: torch.Tensor, low: Any, high: Any, dtype: torch.dtype) -> torch.Tensor:
    """Integers in ``[low, high)`` (the modulo's bias is below ``(high - low) / 2**63``)."""
    return (_shr(z, 1) % (high - low) + low).to(dtype)


for _sample, _names in ((unit, ("rand", "rand_like")), (normal, ("randn", "randn_like"))):
    _rewrite(f"{_names[0]}.default", f"{_names[0]}.generator")(
        lambda keys, size, _s=_sample, **kw: _s(keys.bits(size, _device(kw)), _dtype(kw))
    )
    _rewrite(f"{_names[1]}.default", f"{_names[1]}.generator")(
        lambda keys, x, _s=_sample, **kw: _s(keys.bits(x.shape, _device(kw, x)), _dtype(kw, x))
    )


@_rewrite("randint.default", "randint.generator", "randint.low", "randint.low_generator")
def _randint(keys: Keyed, *bounds_and_size, **kw):
    *bounds, size = bounds_and_size
    low, high = (0, *bounds) if len(bounds) == 1 else bounds
    return _integers(keys.bits(size, _device(kw)), low, high, _dtype(kw, default=torch.int64))


@_rewrite("randint_like.default", "randint_like.generator", "randint_like.Tensor", "randint_like.low_dtype")
@_rewrite("randint_like.low_generator_dtype")
def _randint_like(keys: Keyed, x, *bounds, **kw):
    low, high = (0, *bounds) if len(bounds) == 1 else bounds
    return _integers(keys.bits(x.shape, _device(kw, x)), low, high, _dtype(kw, x))


@_rewrite("random_.to", "random_.from")
def _random_(keys: Keyed, x, *bounds):
    low, high = (0, *bounds) if len(bounds) == 1 else bounds
    if high is None:
        raise _unsupported(_aten.random_.default, "it has no upper bound (pass to=)")
    return x.copy_(_integers(keys.bits(x.shape, x.device), low, high, x.dtype))


def _bernoulli(keys: Keyed, x: torch.Tensor, p: Any) -> torch.Tensor:
    """A tensor like ``x``, 1 with probability ``p`` (``x`` itself when ``p`` is None)."""
    return below(keys.bits(x.shape, x.device), x if p is None else p).to(x.dtype)


_rewrite("bernoulli.default")(lambda keys, x: _bernoulli(keys, x, None))
_rewrite("bernoulli.p", "bernoulli.Tensor")(lambda keys, x, p=0.5: _bernoulli(keys, x, p))
_rewrite("bernoulli_.float", "bernoulli_.Tensor")(lambda keys, x, p=0.5: x.copy_(_bernoulli(keys, x, p)))


@_rewrite("native_dropout.default")
def _native_dropout(keys: Keyed, x, p, train=None):
    if train is False or p == 0:  # what aten's kernel does: nothing drawn
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = below(keys.bits(x.shape, x.device), 1.0 - p)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * keep * scale, keep  # autograd's backward reads this mask


def _uniform(z, dtype, low=0.0, high=1.0):
    return unit(z, dtype) * (high - low) + low


def _normal(z, dtype, mean=0.0, std=1.0):
    return normal(z, dtype) * std + mean


def _exponential(z, dtype, lambd=1.0):
    return (-torch.log1p(-unit(z, _compute(dtype))) / lambd).to(dtype)


def _log_normal(z, dtype, mean=1.0, std=2.0):
    return torch.exp(_normal(z, _compute(dtype), mean, std)).to(dtype)


def _cauchy(z, dtype, median=0.0, sigma=1.0):
    return (median + sigma * torch.tan(math.pi * (unit(z, _compute(dtype)) - 0.5))).to(dtype)


# Each distribution in place (``uniform_``) and functional (``uniform``, what functionalized
# code calls), drawn like its first argument.
for _sample, _functional, _in_place in (
    (_uniform, "uniform.default", "uniform_.default"),
    (_normal, "normal_functional.default", "normal_.default"),
    (_exponential, "exponential.default", "exponential_.default"),
    (_log_normal, "log_normal.default", "log_normal_.default"),
    (_cauchy, "cauchy.default", "cauchy_.default"),
):
    _rewrite(_functional)(lambda keys, x, *a, _s=_sample: _s(keys.bits(x.shape, x.device), x.dtype, *a))
    _rewrite(_in_place)(lambda keys, x, *a, _s=_sample: x.copy_(_s(keys.bits(x.shape, x.device), x.dtype, *a)))


@_rewrite("normal.Tensor_float", "normal.float_Tensor", "normal.Tensor_Tensor")
def _normal_tensors(keys: Keyed, mean, std=1.0):
    like = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape for t in like))
    return normal(keys.bits(shape, like[0].device), like[0].dtype) * std + mean


@_rewrite("normal.float_float")
def _normal_floats(keys: Keyed, mean, std, size, **kw):
    return normal(keys.bits(size, _device(kw)), _dtype(kw)) * std + mean


SUPPORTED: tuple[str, ...] = tuple(sorted({_torch_private.op_name(op) for op in _IMPLS}))
