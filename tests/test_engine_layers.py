"""The engine is one step driver over two parts: the precision layer and a Comm per backend
([Note: engine = precision + communication] in src/mixprec/engines/comm.py). These tests
check the contract from outside: a Comm written by someone else plugs into the same
driver and gives the same numbers, each backend's public methods are reached through the
engine only where the backend has them, and the sharding core answers what it shards."""

from __future__ import annotations

import pytest
import torch

from mixprec import Accelerator
from mixprec.engines import ENGINES, Comm, Engine, SingleComm
from mixprec.policy import PrecisionPolicy
from mixprec.wrappers.model import AutocastGate

from _helpers import make_mlp


class RecordingComm(SingleComm):
    """The single backend, recording which contract hooks the driver calls."""

    name = "recording"

    def __init__(self, policy, device, *, log):
        super().__init__(policy, device)
        self.log = log

    def __getattribute__(self, name):
        if name in HOOKS:
            object.__getattribute__(self, "log").append(name)
        return object.__getattribute__(self, name)


HOOKS = ("attach", "start", "prepare_model", "model_ready", "prepare_optimizer", "grads_changed",
         "after_backward", "fold", "checked", "agree_found_inf", "clip_grads", "global_norm",
         "step_finish", "update_targets", "publish", "step_done", "checks_cleared", "zero_grad",
         "zero_model_grads", "fill_full_state", "state_shards", "state_dtypes", "release")


def _train(comm_cls, mixed_precision, steps=3, **options):
    """A plain loop driven through Engine directly: backward, clip, step, zero_grad."""
    policy = PrecisionPolicy.from_mixed_precision(mixed_precision)
    engine = Engine(policy, torch.device("cpu"), comm_cls, **options)
    model = make_mlp(0)
    engine.prepare_model(model, AutocastGate())
    state = engine.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(3)
    results = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        engine.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        norm = engine.clip_grad_norm_(model.parameters(), 0.5)
        result = engine.step(state)
        results.append((float(norm), result.stepped, result.reason))
        engine.zero_grad(state)
    weights = {k: v.detach().clone() for k, v in engine.full_state_dict(model).items()}
    return engine, results, weights


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_a_comm_written_outside_plugs_into_the_same_driver(mixed_precision):
    log: list[str] = []
    engine, results, weights = _train(RecordingComm, mixed_precision, log=log)
    _, ref_results, ref_weights = _train(SingleComm, mixed_precision)
    # Same driver, same arithmetic: bitwise the single backend's numbers.
    assert results == ref_results
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        assert torch.equal(weights[k], ref_weights[k]), k
    assert engine.name == "recording" and not engine.distributed
    # The driver reached the backend only through the contract's hooks, in the order the
    # contract gives (model before optimizer; the backward's hooks around it; the step's
    # hooks inside step()).
    assert log[0] == "attach"
    first = {h: log.index(h) for h in HOOKS if h in log}
    assert first["start"] < first["prepare_model"] < first["model_ready"] < first["prepare_optimizer"]
    assert first["grads_changed"] < first["after_backward"] < first["global_norm"] < first["step_finish"]
    assert log.count("grads_changed") == 3 and log.count("step_done") == 3 and log.count("zero_grad") == 3
    assert {"clip_grads", "update_targets", "fill_full_state"} <= set(log)


def test_backend_methods_are_reached_through_the_engine_only_where_the_backend_has_them():
    engine = Engine(PrecisionPolicy.from_mixed_precision("bf16"), torch.device("cpu"))
    assert isinstance(engine.comm, Comm) and engine.name == "single"
    assert not hasattr(engine, "unit_names") and not hasattr(engine, "comm_counters")
    with pytest.raises(AttributeError, match="backend 'single' has no full_params"):
        engine.full_params  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'reducers'"):
        engine.reducers  # noqa: B018  (internal state stays on engine.comm)


def test_every_backend_is_a_comm_with_its_engine_options_as_keyword_arguments():
    import inspect

    for name, cls in ENGINES.items():
        assert issubclass(cls, Comm) and cls.name == name
        params = inspect.signature(cls.__init__).parameters
        assert list(params)[:3] == ["self", "policy", "device"], name
        assert all(p.kind is not p.POSITIONAL_OR_KEYWORD for p in list(params.values())[3:]), name


@pytest.mark.parametrize("backend", ["zero2", "zero3"])
def test_sharding_core_answers_what_it_shards(backend):
    acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False,
                      engine_options={"units": ["Linear"]} if backend == "zero3" else None)
    try:
        model = make_mlp(0)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        comm = acc.engine.comm
        held = [p for core in comm.all_cores() for p in core.params]
        # The same Parameter objects as the model's, each once: the core is the one owner.
        assert sorted(map(id, held)) == sorted(id(p) for p in model.parameters())
        assert comm.sharded_ids == {id(p) for p in model.parameters()}
        # The checkpoint dtypes come from the engine's public interface: fp32 masters for
        # every sharded parameter.
        dtypes = acc.engine.state_dtypes([model])
        assert dtypes and all(d == torch.float32 for d in dtypes.values())
        assert hasattr(acc.engine, "comm_counters")
        assert hasattr(acc.engine, "unit_names") == (backend == "zero3")
    finally:
        acc.end_training()
