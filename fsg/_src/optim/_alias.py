"""The named optimizers, each a chain of elementary transformations."""

from __future__ import annotations

from fsg._src import checks
from fsg._src.optim import _checks
from fsg._src.optim._adam_variants import adam_constants, scale_by_amsgrad
from fsg._src.optim._base import AdamWSpec, GradientTransformation, chain
from fsg._src.optim._schedules import ScalarOrSchedule
from fsg._src.optim._transforms import (
    MaskOrFn,
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    trace,
)


def sgd(
    learning_rate: ScalarOrSchedule,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """Stochastic gradient descent, optionally with (Nesterov) momentum.

    Matches ``torch.optim.SGD`` with the same arguments: ``weight_decay`` is L2 (added to the
    gradient; ``mask`` picks the params it applies to), ``dampening`` scales the gradient into
    the momentum buffer from the second step on (``trace``).

    Example:
      >>> opt = fsg.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    """
    _checks.learning_rate("sgd(learning_rate=...)", learning_rate)
    if momentum is not None:
        _checks.non_negative("sgd(momentum=...)", momentum, fix="Pass a momentum such as 0.9, or None for none")
    checks.flag("sgd(nesterov=...)", nesterov)
    _checks.non_negative("sgd(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    _checks.non_negative("sgd(dampening=...)", dampening, fix="Pass 0.0 for none")
    if nesterov and (not momentum or dampening):
        raise checks.fail("sgd(nesterov=True)", "needs a momentum > 0 and dampening=0 (as torch.optim.SGD)",
                          (momentum, dampening), "Pass momentum=0.9, dampening=0.0, say")  # fmt: skip
    parts = [add_decayed_weights(weight_decay, mask=mask)] if weight_decay else []
    if momentum:
        parts.append(trace(decay=momentum, nesterov=nesterov, dampening=dampening))
    return chain(*parts, scale_by_learning_rate(learning_rate))


def adam(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """Adam (Kingma & Ba, 2014): matches ``torch.optim.Adam`` with the same arguments.

    ``weight_decay`` is L2 regularization, added to the gradient before the moments (torch's
    ``Adam``; for decoupled decay use ``adamw``); ``amsgrad`` scales by the largest second
    moment so far (``scale_by_amsgrad``).

    Example:
      >>> opt = fsg.optim.adam(1e-3)
    """
    _adam_checks("adam", learning_rate, b1, b2, eps)
    _checks.non_negative("adam(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    checks.flag("adam(amsgrad=...)", amsgrad)
    scaling = scale_by_amsgrad(b1=b1, b2=b2, eps=eps) if amsgrad else scale_by_adam(b1=b1, b2=b2, eps=eps)
    decay = [add_decayed_weights(weight_decay, mask=mask)] if weight_decay else []
    transformation = chain(*decay, scaling, scale_by_learning_rate(learning_rate))
    if weight_decay or amsgrad:
        return transformation
    # AdamW without decay: compile_step may run the fused AdamW kernel (fsg/_src/passes/fuse_adamw.py).
    return transformation._replace(spec=AdamWSpec(b1, b2, eps, 0.0, None, learning_rate, decay_state=False))


def adamw(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: MaskOrFn = None,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019).

    Matches ``torch.optim.AdamW`` given the same hyperparameters, ``weight_decay`` included:
    its default here is optax's 1e-4, torch's is 1e-2. The decay is scaled by the learning rate,
    so ``p <- p - lr * (adam_update + weight_decay * p)``.

    Args:
      learning_rate: a float or a schedule.
      b1, b2, eps: Adam's constants.
      weight_decay: the decoupled decay coefficient (default 1e-4, optax's; ``torch.optim.AdamW``'s
        is 1e-2, which ``fsg.optim.from_torch`` carries over).
      mask: which params to decay (see ``add_decayed_weights``); all when ``None``.
      amsgrad: scale by the largest second moment so far (``scale_by_amsgrad``).

    Example:
      >>> opt = fsg.optim.adamw(fsg.optim.warmup_cosine(3e-4, warmup=100, total=10_000), weight_decay=0.1)
    """
    _adam_checks("adamw", learning_rate, b1, b2, eps)
    _checks.non_negative("adamw(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    checks.flag("adamw(amsgrad=...)", amsgrad)
    transformation = chain(
        scale_by_amsgrad(b1=b1, b2=b2, eps=eps) if amsgrad else scale_by_adam(b1=b1, b2=b2, eps=eps),
        add_decayed_weights(weight_decay, mask=mask),
        scale_by_learning_rate(learning_rate),
    )
    if amsgrad:
        return transformation
    # compile_step may replace this traced math by the fused kernel (fsg/_src/passes/fuse_adamw.py).
    return transformation._replace(spec=AdamWSpec(b1, b2, eps, weight_decay, mask, learning_rate))


def lion(
    learning_rate: ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """Lion (Chen et al., 2023) with decoupled weight decay.

    Example:
      >>> opt = fsg.optim.lion(1e-4, weight_decay=0.1)
    """
    _checks.learning_rate("lion(learning_rate=...)", learning_rate)
    _checks.beta("lion(b1=...)", b1)
    _checks.beta("lion(b2=...)", b2)
    _checks.non_negative("lion(weight_decay=...)", weight_decay, fix="Pass 0.0 for no decay")
    return chain(
        scale_by_lion(b1=b1, b2=b2),
        add_decayed_weights(weight_decay, mask=mask),
        scale_by_learning_rate(learning_rate),
    )


def _adam_checks(name: str, learning_rate: ScalarOrSchedule, b1: float, b2: float, eps: float) -> None:
    _checks.learning_rate(f"{name}(learning_rate=...)", learning_rate)
    adam_constants(name, b1, b2, eps)
