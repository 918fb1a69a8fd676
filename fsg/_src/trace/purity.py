"""Checks that ``loss_fn`` is pure, with the user's source line in every error.

A loss may not mutate its inputs, nor need a tensor's value on the host while it is traced:
the graph is traced once and replayed, so either would silently change its meaning. The
traced graph shows *that* a rule was broken; ``diagnose`` re-runs the loss alone on fake
tensors under a dispatch mode that stops at the first offending op, to say *where*.
"""

from __future__ import annotations

import os
import re
import traceback
from typing import Any, Callable

import torch
from torch import fx

from fsg._src import _torch_private, graph_facts, tree
from fsg._src.errors import FsgError, HostSyncError, ImpureLossError
from fsg._src.trace import libraries, markers, refusals

_TORCH_DIR = os.path.dirname(torch.__file__)
_FSG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SYNC_FIX = (
    "The step is traced once into a static graph and replayed, so a value known only at run "
    "time cannot steer Python. Use tensor ops instead: torch.where(cond, a, b) for a branch; "
    "keep scalars as 0-d tensors (return them in the aux dict to log them) rather than "
    "calling .item(), float() or bool() on them."
)
_PURE_FIX = (
    "loss_fn must be pure: parameters and batch are read-only inside it, and the optimizer "
    "alone updates the parameters. Use the out-of-place op (x = x * 2, not x.mul_(2)), or "
    "clone first."
)


def _is_user_file(filename: str) -> bool:
    return not (filename.startswith(_TORCH_DIR) or filename.startswith(_FSG_DIR) or filename.startswith("<"))


def user_frame(frames: list[traceback.FrameSummary]) -> str:
    """The innermost frame of user code (not torch, not fsg) among ``frames``."""
    for frame in reversed(frames):
        if _is_user_file(frame.filename):
            return f'File "{frame.filename}", line {frame.lineno}: {(frame.line or "").strip()}'
    for frame in reversed(frames):  # code typed at the prompt or in an old IPython cell: no file, a line number
        if frame.filename == "<stdin>" or frame.filename.startswith("<ipython-input"):
            return f'File "{frame.filename}", line {frame.lineno}'
    return "(source line unknown)"


def torch_callee(frames: list[traceback.FrameSummary]) -> str:
    """``'torch.nn.functional.gaussian_nll_loss'``: the torch function the innermost user line
    called, where the error came from inside torch's public Python code; else ``''``."""
    users = [i for i, frame in enumerate(frames) if _is_user_file(frame.filename)]
    callee = frames[users[-1] + 1] if users and users[-1] + 1 < len(frames) else None
    if callee is None or not callee.filename.startswith(_TORCH_DIR):
        return ""
    module = os.path.relpath(callee.filename, os.path.dirname(_TORCH_DIR)).removesuffix(".py").replace(os.sep, ".")
    module = module.removesuffix(".__init__")
    return "" if any(part.startswith("_") for part in module.split(".")) else f"{module}.{callee.name}"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?P<code>[^\n]*)')


def user_frame_of_node(node: fx.Node) -> str:
    """The innermost line of user code recorded for a graph node (module ``forward`` frames
    only: that is what ``make_fx`` records)."""
    frames = [
        traceback.FrameSummary(f, int(line), fn, line=code.strip())
        for f, line, fn, code in _FRAME.findall(node.meta.get("stack_trace") or "")
    ]
    found = user_frame(frames)
    return found if frames else f"graph node {node.name}"


def trace(fn: Callable[..., Any], *inputs: Any, source_lines: bool, decompositions: Any) -> fx.GraphModule:
    """``fn`` traced on fake copies of ``inputs`` (stage 1's train and eval steps), a
    data-dependent branch reported as a ``HostSyncError`` at the user's line.

    oneDNN is off while tracing: torch's ``nn.LSTM`` decomposition picks oneDNN's
    ``mkldnn_rnn_layer`` for a CPU input that needs no gradient even where the weights need
    one, and traced on fake tensors that kernel's backward gets no workspace (the step then
    fails: "Expected a proper Tensor but got None ... 'workspace'", torch 2.13). Without it the
    LSTM traces as its matmuls, the same computation; what runs the graph later is unaffected.
    The flag is switched under a context manager that restores it and works after
    ``torch.backends.disable_global_flags()``, where assigning ``torch.backends.mkldnn.enabled``
    raises (``_torch_private.mkldnn_disabled``)."""
    try:
        with _torch_private.mkldnn_disabled(), libraries.tracing():  # as the libraries run eagerly, leaving nothing of the trace in them
            return _torch_private.trace_fake(fn, *inputs, source_lines=source_lines, decompositions=decompositions)
    except _torch_private.DATA_DEPENDENT_ERRORS as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        callee = torch_callee(frames)
        where = user_frame(frames) + (f" (inside {callee})" if callee else "")
        raise host_sync_error(where, "data-dependent Python control flow") from exc
    except TypeError as exc:  # a tensor where torch wants a Python int (packed RNN sequences' batch sizes)
        if "FakeTensor" not in str(exc):
            raise
        where = user_frame(traceback.extract_tb(exc.__traceback__))
        raise host_sync_error(where, f"a tensor's value used as a Python number, such as a size: {exc}") from exc
    except _torch_private.DYNAMIC_SHAPE_ERROR as exc:  # (F.ctc_loss, say)
        func = getattr(exc, "func", None)
        raise refusals.dynamic_shape_error(func, user_frame(traceback.extract_tb(exc.__traceback__))) from exc


def host_sync_error(where: str, what: str) -> HostSyncError:
    return HostSyncError(f"loss_fn needs the value of a tensor on the host ({what}) at {where}. {_SYNC_FIX}")


def impure_error(path: str, op: str, where: str) -> ImpureLossError:
    return ImpureLossError(f"loss_fn writes in place to {path} ({op}) at {where}. {_PURE_FIX}")


class _Violation(Exception):
    def __init__(self, error: FsgError):
        self.error = error


class _Found(Exception):
    def __init__(self, where: str):
        self.where = where


class _Watch(_torch_private.TorchDispatchMode):
    """Stops at the first host read or in-place write to a watched input, or at the first
    call of ``stop_at``."""

    def __init__(self, watched: dict[int, str], stop_at: Any = None):
        super().__init__()
        self._watched = watched
        self._stop_at = stop_at

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self._stop_at:
            raise _Found(user_frame(traceback.extract_stack()))
        if func in _torch_private.HOST_SYNC_OPS:
            where = user_frame(traceback.extract_stack())
            raise _Violation(host_sync_error(where, ".item(), float(), int() or bool() of a tensor"))
        for i in _torch_private.mutated_args(func):
            arg = args[i] if i < len(args) else None
            if isinstance(arg, torch.Tensor) and id(_torch_private.view_base(arg)) in self._watched:
                path = self._watched[id(_torch_private.view_base(arg))]
                where = user_frame(traceback.extract_stack())
                raise _Violation(impure_error(path, _torch_private.op_name(func), where))
        return func(*args, **kwargs)


def _run_on_fakes(loss_fn: Callable[..., Any], params: Any, batch: Any, buffers: Any, stop_at: Any = None) -> None:
    mode = _torch_private.fake_mode()

    def fake(t: torch.Tensor) -> torch.Tensor:  # real, fake or DTensor: same global shape
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)

    with mode:
        fake_params = tree.tree_map(fake, params)
        fake_batch = tree.tree_map(fake, batch)
    watched = {}
    for root, fakes in (("params", fake_params), ("batch", fake_batch)):
        leaves, _ = tree.flatten(fakes)
        watched.update({id(leaf): path for leaf, path in zip(leaves, tree.leaf_paths(fakes, root))})
    with mode, _Watch(watched, stop_at):
        loss_fn(fake_params, fake_batch, buffers) if buffers else loss_fn(fake_params, fake_batch)


def diagnose(loss_fn: Callable[..., Any], params: Any, batch: Any, buffers: Any) -> FsgError | None:
    """Runs ``loss_fn`` on fake copies of its inputs and returns the first purity violation
    (with its source line), or ``None`` if the loss ran clean."""
    try:
        _run_on_fakes(loss_fn, params, batch, buffers)
    except _Violation as violation:
        return violation.error
    except _torch_private.DATA_DEPENDENT_ERRORS as exc:
        where = user_frame(traceback.extract_tb(exc.__traceback__))
        return host_sync_error(where, "data-dependent Python control flow")
    except Exception:  # a diagnosis is best effort: the caller raises its own error
        return None
    return None


def locate(loss_fn: Callable[..., Any], params: Any, batch: Any, buffers: Any, op: Any) -> str | None:
    """The user source line where ``loss_fn`` first calls aten ``op`` (run on fake tensors),
    or ``None`` if the forward pass does not call it."""
    try:
        _run_on_fakes(loss_fn, params, batch, buffers, stop_at=op)
    except _Found as found:
        return found.where
    except Exception:  # best effort
        return None
    return None


def constant_write(gm: fx.GraphModule) -> fx.Node | None:
    """The first node that writes in place into a tensor the step was not given (a module's own
    tensor, which the graph holds as a constant), or ``None``: torch's functionalization would
    stop on it with an internal assert."""
    return next((n for n in gm.graph.nodes if any(t.op == "get_attr" for t in graph_facts.writes(n))), None)


def constant_write_error(node: fx.Node, where: str | None) -> ImpureLossError:
    return ImpureLossError(
        f"loss_fn writes in place ({node.target}) to a tensor the step was not given, at "
        f"{where or user_frame_of_node(node)}: a module's own tensor, which the graph holds as a constant, most "
        f"often a buffer such as BatchNorm's running statistics. Put the module's buffers in the state: "
        f"step.init(params, buffers=fsg.buffers(model)), take them as loss_fn(params, batch, buffers) and "
        f"hand them on with fsg.apply(model, params, ..., buffers=buffers) (docs/models.md#buffers); or "
        f"run that module in eval mode."
    )


def check_constants(gm: fx.GraphModule, locate: Callable[[Any], str | None]) -> None:
    """Raises for a constant the traced step must not hold: a tensor it writes in place (a
    module buffer not in the state), or a trainable module parameter the loss read directly
    rather than through ``fsg.apply`` (its initial value, frozen into the graph, with no
    gradient: silently untrained). ``locate(op)``: the user's line that first calls ``op``."""
    written = constant_write(gm)
    if written is not None:
        raise constant_write_error(written, locate(written.target))
    for node in gm.graph.nodes:
        value = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if isinstance(value, torch.nn.Parameter) and value.requires_grad:
            reader = next((u for u in node.users if u.op == "call_function"), None)
            where = (reader is not None and locate(reader.target)) or "(source line unknown)"
            raise ImpureLossError(
                f"loss_fn reads a module's own trainable parameter (shape {tuple(value.shape)}, {value.dtype}) "
                f"directly, not through fsg.apply, at {where}: a compiled step would hold its initial value as "
                f"a constant and never train it. Read it from params (params['<its name>'], the keys of "
                f"fsg.params(model)), or call the module through fsg.apply first; a module meant to stay "
                f"constant (a teacher) should be frozen: model.requires_grad_(False)."
            )


def has_host_sync(gm: fx.GraphModule) -> bool:
    """Whether the graph reads a tensor's value on the host."""
    return any(n.op == "call_function" and n.target in _torch_private.HOST_SYNC_OPS for n in gm.graph.nodes)


def _base(node: Any) -> fx.Node | None:
    """Follows view ops back to the graph input or parameter read they view, if any."""
    while isinstance(node, fx.Node):
        if node.op == "placeholder" or node.target is markers.PARAM_USE:
            return node
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.returns:
            return None
        alias = schema.returns[0].alias_info
        if alias is None or alias.is_write:
            return None
        node = node.args[0]
    return None


def writes_to_inputs(gm: fx.GraphModule, inputs: set[str]) -> bool:
    """Whether some node writes in place to a parameter as the loss reads it, or to one of
    the placeholders named in ``inputs``."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg_schema, arg in zip(schema.arguments, node.args):
            if arg_schema.alias_info is not None and arg_schema.alias_info.is_write:
                base = _base(arg)
                if base is not None and (base.op != "placeholder" or base.name in inputs):
                    return True
    return False
