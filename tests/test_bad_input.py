"""Every public entry point answers a bad input with an ``fsg.FsgError`` subclass whose message
names the argument, leaf or key, states the rule and suggests the fix (issue 16). Each case is
what a new user might write; the list in docs/compiling.md#errors follows this file."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import pytest
import torch

import fsg
import fsg.testing
from fsg import ArgumentError
from tests.helpers import mlp, mse_loss_fn, regression_batch

MODEL = mlp()
LOSS = mse_loss_fn(MODEL)
BN = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))  # takes regression_batch()["x"]


class Case(NamedTuple):
    run: Callable[[Any], Any]  # given pytest's tmp_path
    error: type
    names: tuple[str, ...]  # what the message must contain


def compile_(loss_fn=LOSS, **kwargs):
    kwargs.setdefault("optimizer", fsg.optim.sgd(0.1))
    return fsg.compile_step(loss_fn, backend="eager", **kwargs)


def first_step(loss_fn=LOSS, batch=None, state=None, **kwargs):
    step = compile_(loss_fn, **kwargs)
    state = step.init(fsg.params(MODEL)) if state is None else state(step)
    return step(state, regression_batch() if batch is None else batch)


def _no_grad_loss(params, batch):
    with torch.no_grad():
        return LOSS(params, batch)


def adamw_state(change: Callable[[fsg.TrainState], fsg.TrainState]):
    def make(_step):
        step = compile_(optimizer=fsg.optim.adamw(1e-3))
        return change(step.init(fsg.params(MODEL)))

    return make


def with_aux(aux: Any):
    return lambda params, batch: (LOSS(params, batch), aux)


def saved(tmp_path, state=None):
    path = tmp_path / "ckpt"
    fsg.checkpoint.save(path, {"w": torch.ones(2)} if state is None else state)
    return path


def manager(tmp_path, **kwargs):
    return fsg.checkpoint.CheckpointManager(tmp_path / "run", **kwargs)


def a_file(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    return path


CASES = {
    # compile_step
    "optimizer None": Case(lambda t: compile_(optimizer=None), ArgumentError,
                           ("compile_step(optimizer=...)", "GradientTransformation", "fsg.optim.adamw")),
    "optimizer from torch.optim": Case(lambda t: compile_(optimizer=torch.optim.AdamW), ArgumentError,
                                       ("compile_step(optimizer=...)", "not torch.optim classes")),
    "loss_fn not callable": Case(lambda t: compile_(loss_fn="mse"), ArgumentError, ("compile_step(loss_fn)", "callable")),
    "loss_fn a module": Case(lambda t: compile_(loss_fn=MODEL), ArgumentError, ("not a module", "fsg.apply(model, params")),
    "mesh not a Mesh": Case(lambda t: fsg.compile_step(LOSS, "dp=2", optimizer=fsg.optim.sgd(0.1)), ArgumentError,
                            ("compile_step(mesh=...)", "fsg.Mesh")),
    "accum_steps 0": Case(lambda t: compile_(accum_steps=0), ArgumentError, ("compile_step(accum_steps=...)", ">= 1", "int 0")),
    "accum_steps float": Case(lambda t: compile_(accum_steps=2.0), ArgumentError, ("accum_steps", "float 2.0")),
    "unknown backend": Case(lambda t: fsg.compile_step(LOSS, optimizer=fsg.optim.sgd(0.1), backend="xla"), ArgumentError,
                            ("compile_step(backend=...)", "'xla'", "inductor")),
    "param_sharding a P": Case(lambda t: compile_(param_sharding=fsg.P("tp")), ArgumentError,
                               ("param_sharding", "fsg.sharding.rules([], default=P('tp'))")),
    "batch_sharding a str": Case(lambda t: compile_(batch_sharding="dp"), ArgumentError, ("batch_sharding", "fsg.P('dp')")),
    "donate not a bool": Case(lambda t: compile_(donate="yes"), ArgumentError, ("compile_step(donate=...)", "True or False")),
    "bucket_mb negative": Case(lambda t: compile_(bucket_mb=-1), ArgumentError, ("compile_step(bucket_mb=...)", ">= 0")),
    "precision not a Policy": Case(lambda t: compile_(precision="bf16"), ArgumentError, ("precision", "fsg.Policy")),
    # step.init
    "init with the module": Case(lambda t: compile_().init(MODEL), ArgumentError, ("step.init(params)", "fsg.params(model)")),
    "init with a float leaf": Case(lambda t: compile_().init({"w": 1.0}), fsg.NonTensorLeafError, ("params['w']", "torch.tensor")),
    "init without float params": Case(lambda t: compile_().init({"ids": torch.arange(3)}), ArgumentError,
                                      ("step.init(params)", "no floating-point tensor")),
    "init seed not an int": Case(lambda t: compile_().init(fsg.params(MODEL), seed="0"), ArgumentError, ("step.init(seed=...)",)),
    "init seed beyond int64": Case(lambda t: compile_().init(fsg.params(MODEL), seed=2**64), ArgumentError,
                                   ("step.init(seed=...)", "2**63")),
    "init with model.parameters()": Case(lambda t: compile_().init(MODEL.parameters()), ArgumentError,
                                         ("step.init(params)", "not an iterator", "fsg.params(model)")),
    "batch leaf a list of tensors": Case(
        lambda t: first_step(batch={"x": [regression_batch()["x"]], "y": regression_batch()["y"]}), fsg.BatchError,
        ("batch['x'] (a list of 1 tensor)", "torch.stack", "helpers.py\", line 27")),
    # the state at the first call
    "state not a TrainState": Case(lambda t: first_step(state=lambda s: {"params": fsg.params(MODEL)}), ArgumentError,
                                   ("state must be the fsg.TrainState", "step.init(fsg.params(model))")),
    "state of another optimizer": Case(lambda t: first_step(state=adamw_state(lambda s: s)), fsg.StructureMismatchError,
                                       ("state.opt_state", "unexpected", "mu['0.bias']", "step.init(params)")),
    "state with a param missing": Case(
        lambda t: first_step(optimizer=fsg.optim.adamw(1e-3), state=adamw_state(
            lambda s: s._replace(params={k: v for k, v in s.params.items() if k != "0.bias"}))),
        fsg.StructureMismatchError, ("state.opt_state", "mu['0.bias']")),
    "state with params of another model": Case(
        lambda t: first_step(optimizer=fsg.optim.adamw(1e-3), state=adamw_state(
            lambda s: s._replace(params=fsg.params(mlp(d_hidden=16))))),
        fsg.StructureMismatchError, ("has shape (32,)", "(16,)", "do not belong together")),
    "state.rng malformed": Case(
        lambda t: first_step(optimizer=fsg.optim.adamw(1e-3), state=adamw_state(lambda s: s._replace(rng=torch.zeros(3)))),
        ArgumentError, ("state.rng", "shape (2,)")),
    # the batch
    "batch leaf a float": Case(lambda t: first_step(batch={"x": regression_batch()["x"], "y": 0.5}), fsg.NonTensorLeafError,
                               ("batch['y']", "float", "torch.Tensor")),
    "batch leaf a numpy array": Case(lambda t: first_step(batch={**regression_batch(), "x": np.zeros((16, 8), np.float32)}),
                                     fsg.NonTensorLeafError, ("batch['x']", "ndarray")),
    "batch not divisible by accum_steps": Case(lambda t: first_step(accum_steps=3), fsg.BatchError,
                                               ("batch['x']", "16 rows", "accum_steps=3")),
    # loss_fn and what it returns
    "loss_fn takes one argument": Case(lambda t: first_step(loss_fn=lambda params: 0.0), ArgumentError,
                                       ("loss_fn(params, batch)", "two positional parameters")),
    "loss not reduced": Case(lambda t: first_step(loss_fn=lambda p, b: fsg.apply(MODEL, p, b["x"])), fsg.LossNotScalarError,
                             ("shape (16, 4)", ".mean()")),
    "loss of shape (1,)": Case(lambda t: first_step(loss_fn=lambda p, b: LOSS(p, b).reshape(1)), fsg.LossNotScalarError,
                               ("shape (1,)", "0-d")),
    "loss an integer tensor": Case(lambda t: first_step(loss_fn=lambda p, b: LOSS(p, b).long()), fsg.LossNotScalarError,
                                   ("torch.int64", "floating-point")),
    "loss computed under torch.no_grad": Case(lambda t: first_step(loss_fn=_no_grad_loss), fsg.LossNotScalarError,
                                              ("does not depend on any trained parameter", "torch.no_grad()")),
    "loss detached": Case(lambda t: first_step(loss_fn=lambda p, b: LOSS(p, b).detach()), fsg.LossNotScalarError,
                          ("no grad_fn", ".detach()")),
    "aux metric not a tensor": Case(lambda t: first_step(loss_fn=with_aux({"acc": 0.5})), fsg.LossNotScalarError,
                                    ("aux metric 'acc'", "float", "tensor")),
    "aux key not a string": Case(lambda t: first_step(loss_fn=with_aux({1: torch.zeros(())})), fsg.LossNotScalarError,
                                 ("key 1", "strings")),
    "aux not a dict": Case(lambda t: first_step(loss_fn=with_aux([torch.zeros(())])), fsg.LossNotScalarError,
                           ("aux output", "list")),
    "aux shadows a metric": Case(lambda t: first_step(loss_fn=with_aux({"loss": torch.zeros(())})), fsg.LossNotScalarError,
                                 ("'loss'", "built-in metric", "rename")),
    # optimizers and schedules
    "negative learning rate": Case(lambda t: fsg.optim.sgd(-0.1), ArgumentError, ("sgd(learning_rate=...)", ">= 0", "-0.1")),
    "learning rate a str": Case(lambda t: fsg.optim.adamw("3e-4"), ArgumentError, ("adamw(learning_rate=...)", "str")),
    "nesterov without momentum": Case(lambda t: fsg.optim.sgd(0.1, nesterov=True), ArgumentError,
                                      ("sgd(nesterov=True)", "momentum")),
    "nesterov with dampening": Case(lambda t: fsg.optim.sgd(0.1, momentum=0.9, nesterov=True, dampening=0.1), ArgumentError,
                                    ("sgd(nesterov=True)", "dampening=0")),
    "nadam decoupled not a bool": Case(lambda t: fsg.optim.nadam(decoupled_weight_decay="yes"), ArgumentError,
                                       ("nadam(decoupled_weight_decay=...)",)),
    "radam beta2 of 1": Case(lambda t: fsg.optim.radam(b2=1.0), ArgumentError, ("radam(b2=...)", "[0.0, 1.0)")),
    "adadelta negative decay": Case(lambda t: fsg.optim.adadelta(weight_decay=-1.0), ArgumentError,
                                    ("adadelta(weight_decay=...)", ">= 0")),
    "negative momentum": Case(lambda t: fsg.optim.sgd(0.1, momentum=-0.9), ArgumentError, ("sgd(momentum=...)",)),
    "beta1 of 1": Case(lambda t: fsg.optim.adam(1e-3, b1=1.0), ArgumentError, ("adam(b1=...)", "[0.0, 1.0)")),
    "negative beta2": Case(lambda t: fsg.optim.adamw(1e-3, b2=-0.1), ArgumentError, ("adamw(b2=...)", "[0.0, 1.0)")),
    "eps of 0": Case(lambda t: fsg.optim.adamw(1e-3, eps=0.0), ArgumentError, ("adamw(eps=...)", "> 0", "1e-8")),
    "negative weight decay": Case(lambda t: fsg.optim.adamw(1e-3, weight_decay=-0.1), ArgumentError,
                                  ("adamw(weight_decay=...)", ">= 0")),
    "lion beta above 1": Case(lambda t: fsg.optim.lion(1e-4, b1=1.5), ArgumentError, ("lion(b1=...)",)),
    "clip norm of 0": Case(lambda t: fsg.optim.clip_by_global_norm(0.0), ArgumentError, ("clip_by_global_norm(max_norm=...)", "> 0")),
    "chain of a non-transformation": Case(lambda t: fsg.optim.chain(fsg.optim.sgd(0.1), 3), ArgumentError,
                                          ("chain(...): argument 1", "GradientTransformation")),
    "schedule builder passed uncalled": Case(lambda t: fsg.optim.adamw(fsg.optim.cosine), ArgumentError,
                                             ("adamw(learning_rate=...)", "schedule", "fsg.optim.cosine(3e-4, 10_000)")),
    "schedule returning a float": Case(lambda t: fsg.optim.sgd(lambda count: 0.1), ArgumentError,
                                       ("sgd(learning_rate=...)", "returned float 0.1", "torch ops")),
    "schedule returning a vector": Case(lambda t: fsg.optim.sgd(lambda count: torch.ones(3)), ArgumentError,
                                        ("0-d", "shape (3,)")),
    "warmup not below total": Case(lambda t: fsg.optim.warmup_cosine(1e-3, warmup=100, total=100), ArgumentError,
                                   ("warmup_cosine(warmup=..., total=...)", "warmup < total")),
    "cosine over 0 steps": Case(lambda t: fsg.optim.cosine(1e-3, 0), ArgumentError, ("cosine(decay_steps=...)", ">= 1")),
    "piecewise boundary negative": Case(lambda t: fsg.optim.piecewise(1.0, {-5: 0.1}), ArgumentError,
                                        ("piecewise: boundary -5", ">= 0")),
    "decay mask of other params": Case(lambda t: compile_(optimizer=fsg.optim.adamw(1e-3, mask={"w": True})).init(
        fsg.params(MODEL)), ArgumentError, ("add_decayed_weights(mask=...)", "params['0.weight']", "unexpected")),
    # Mesh, P and sharding rules
    "mesh axis of size 0": Case(lambda t: fsg.Mesh({"dp": 0}), fsg.MeshError, ("'dp'", "size 0", "positive")),
    "mesh axes with a duplicate name": Case(lambda t: fsg.Mesh([("dp", 1), ("dp", 1)]), fsg.MeshError,
                                            ("'dp' more than once", "dict")),
    "mesh larger than the world": Case(lambda t: fsg.Mesh({"dp": 2}), fsg.MeshError,
                                       ("world size is 1", "fsg.distributed.initialize()")),
    "mesh axis without a name": Case(lambda t: fsg.Mesh({"": 1}), fsg.MeshError, ("non-empty strings",)),
    "mesh of an unknown device type": Case(lambda t: fsg.Mesh({"dp": 1}, device_type="tpu"), fsg.MeshError,
                                           ("device_type", "'tpu'")),
    "P with an int entry": Case(lambda t: fsg.P("dp", 0), fsg.MeshError, ("entry 1", "int 0", "axis names")),
    "rule regex that does not compile": Case(lambda t: fsg.sharding.rules([("blocks.(", fsg.P())]), ArgumentError,
                                             ("rule 0", "'blocks.('", "does not compile")),
    "rule spec not a P": Case(lambda t: fsg.sharding.rules([(".*", "tp")]), ArgumentError,
                              ("spec of rule 0", "fsg.P('tp', None)")),
    "rule not a pair": Case(lambda t: fsg.sharding.rules([".*weight"]), ArgumentError, ("rule 0", "pair (regex, spec)")),
    "rule function not giving a P": Case(lambda t: fsg.sharding.rules([(".*", lambda shape, mesh: "tp")]).spec_for(
        "w", (4,), fsg.Mesh({"tp": 1})), ArgumentError, ("for the parameter 'w'", "fsg.P")),
    "rules added to a non-rule": Case(lambda t: fsg.sharding.fsdp() + fsg.P("dp"), ArgumentError,
                                     ("Rules + other", "fsg.sharding rules")),
    # Policy
    "Policy with an integer dtype": Case(lambda t: fsg.Policy(param=torch.int8), ArgumentError,
                                         ("fsg.Policy(param=...)", "torch.int8", "floating-point")),
    # checkpoints
    "save a non-tensor leaf": Case(lambda t: saved(t, {"w": object()}), fsg.CheckpointError, ("state['w']", "object", "scalars")),
    "save a complex32 tensor": Case(lambda t: saved(t, {"z": torch.zeros(2, dtype=torch.complex32)}), fsg.CheckpointError,
                                    ("state['z']", "complex32", "view_as_real")),
    "save over a checkpoint": Case(lambda t: fsg.checkpoint.save(saved(t), {"w": torch.ones(2)}), fsg.CheckpointError,
                                   ("already exists",)),
    "save unencodable metadata": Case(lambda t: fsg.checkpoint.save(t / "c", {}, metadata={"f": object()}),
                                      fsg.CheckpointError, ("metadata", "msgpack")),
    "restore a missing directory": Case(lambda t: fsg.checkpoint.restore(t / "nope", like={}), fsg.CheckpointError,
                                        ("no checkpoint at", "nope", "no such directory")),
    "restore into another tree": Case(lambda t: fsg.checkpoint.restore(saved(t), like={"b": torch.ones(2)}),
                                      fsg.CheckpointError, ("state['b']", "state['w']", "like=")),
    "restore into another dtype": Case(lambda t: fsg.checkpoint.restore(saved(t), like={"w": torch.ones(2, dtype=torch.int32)}),
                                       fsg.CheckpointError, ("state['w']", "float32[2]", "int32[2]")),
    "restore select outside the state": Case(lambda t: fsg.checkpoint.restore(saved(t), like={}, select="params"),
                                             fsg.CheckpointError, ("select='params'", "state.params")),
    "export_safetensors of a non-tensor": Case(lambda t: fsg.checkpoint.export_safetensors(t / "m.safetensors", {"w": 1.0}),
                                               fsg.CheckpointError, ("export_safetensors", "'w'", "float")),
    "export_safetensors of complex128": Case(lambda t: fsg.checkpoint.export_safetensors(
        t / "m.safetensors", {"z": torch.zeros(2, dtype=torch.complex128)}), fsg.CheckpointError,
        ("export_safetensors", "'z'", "complex128", "complex64, or torch.view_as_real")),
    "manager keeping 0": Case(lambda t: manager(t, max_to_keep=0), ArgumentError, ("max_to_keep", ">= 1", "None")),
    "manager interval 0": Case(lambda t: manager(t, save_interval_steps=0), ArgumentError, ("save_interval_steps", ">= 1")),
    "manager in a file": Case(lambda t: fsg.checkpoint.CheckpointManager(a_file(t)), fsg.CheckpointError,
                              ("not_a_dir", "is a file")),
    "manager save of a negative step": Case(lambda t: manager(t).save(-1, {"w": torch.ones(1)}), ArgumentError,
                                            ("CheckpointManager.save(step)", ">= 0")),
    "manager restore of latest() None": Case(lambda t: manager(t).restore(None, like={}), fsg.CheckpointError,
                                             ("restore(None)", "restore_or_init")),
    "manager restore_or_init of a state": Case(lambda t: manager(t).restore_or_init({"w": torch.ones(1)}), ArgumentError,
                                               ("restore_or_init(init_fn)", "callable", "lambda")),
    # fsg.distributed and fsg.testing
    "unknown process-group backend": Case(lambda t: fsg.distributed.initialize(backend="nccI"), ArgumentError,
                                          ("backend='nccI'", "'gloo'")),
    # ops a static graph cannot hold, and modules that write what the step was not given
    "an op with a data-dependent output shape (F.ctc_loss)": Case(lambda t: first_step(loss_fn=lambda p, b: torch.nn.functional.ctc_loss(
        fsg.apply(MODEL, p, b["x"]).log_softmax(-1)[:, None], torch.tensor([[1]]), [b["x"].shape[0]], [1])),
        fsg.UnsupportedError, ("aten._ctc_loss", "output shape", "test_bad_input.py")),
    "masked_select by a captured mask (every backend; AOTAutograd and Inductor crashed in torch)": Case(
        lambda t: first_step(loss_fn=lambda p, b: LOSS(p, b) + p["0.bias"].masked_select(torch.arange(32) % 3 == 0).sum()),
        fsg.UnsupportedError, ("aten.masked_select", "output shape", "test_bad_input.py")),
    "a BatchNorm buffer not in the state": Case(lambda t: first_step(loss_fn=lambda p, b: fsg.apply(BN, p, b["x"]).square().mean(),
        state=lambda s: s.init(fsg.params(BN))), fsg.ImpureLossError, ("a tensor the step was not given", "fsg.buffers(model)")),
    "a module parameter read outside fsg.apply": Case(lambda t: first_step(
        loss_fn=lambda p, b: 0.1 * MODEL[0].weight.square().sum() + LOSS(p, b)), fsg.ImpureLossError,
        ("trainable parameter (shape (32, 8)", "not through fsg.apply", "test_bad_input.py", "params[")),
    "MultiRank of 0 ranks": Case(lambda t: fsg.testing.MultiRank(0), ArgumentError, ("MultiRank(world_size)", ">= 1")),
    "MultiRank on an unknown device": Case(lambda t: fsg.testing.MultiRank(2, device="gpu"), ArgumentError,
                                           ("MultiRank(device=...)", "'cpu' or 'cuda'")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_input_raises_an_fsg_error_naming_it(case, tmp_path):
    with pytest.raises(fsg.FsgError) as info:
        case.run(tmp_path)
    assert isinstance(info.value, case.error), f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for name in case.names:
        assert name in message, f"{name!r} not in: {message}"


def test_there_are_at_least_30_kinds():
    assert len(CASES) >= 30


def test_argument_errors_are_still_value_and_type_errors():
    with pytest.raises(ValueError):
        fsg.optim.sgd(-1.0)
    with pytest.raises(TypeError):
        fsg.compile_step(LOSS, optimizer=None)
