"""The facade's run is built once (src/mixprec/facade/run.py): the configuration is resolved
once, and an engine's settings are written by one EngineSpec, so every engine an Accelerator
builds (at __init__, after ``free_memory()``, after unpickling, after unpickling twice)
carries the settings the running engine had."""

from __future__ import annotations

import pickle

import pytest
import torch

from mixprec import Accelerator, DistributedDataParallelKwargs
from mixprec.facade import run as run_module
from _helpers import END_AFTER_TEST

_MADE = END_AFTER_TEST  # ended after each test by tests/conftest.py


def _settings(engine) -> tuple:
    return engine.nonfinite_grads, engine.clip_in_step, engine.cache_weight_casts


def test_the_config_is_resolved_once_with_ddp_kwargs(monkeypatch):
    calls = []
    real = run_module.resolve_config

    def counting(*args, **kwargs):
        calls.append(kwargs.get("backend_options"))
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "resolve_config", counting)
    acc = Accelerator(backend="ddp", device=torch.device("cpu"), log_policy=False,
                      engine_options={"bucket_cap_mb": 8.0},
                      kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=4, find_unused_parameters=True)])
    _MADE.append(acc)
    assert len(calls) == 1
    cfg = acc.config.config.ddp
    # the handler's options apply to the ddp block; engine_options win on a shared key
    assert cfg.find_unused_parameters is True and cfg.bucket_cap_mb == 8.0
    assert acc.config.source("ddp.bucket_cap_mb") == "argument engine_options['bucket_cap_mb']"
    assert acc._engine_spec.options["find_unused_parameters"] is True


def test_ddp_kwargs_do_not_reach_another_backend():
    acc = Accelerator(backend="single", device=torch.device("cpu"), log_policy=False,
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    _MADE.append(acc)
    assert acc.config.settings["ddp.find_unused_parameters"].kind == "default"
    assert "find_unused_parameters" not in acc._engine_spec.options


def test_every_engine_carries_the_running_engines_settings():
    acc = Accelerator(mixed_precision="bf16", device=torch.device("cpu"), log_policy=False,
                      nonfinite_grads="raise", clip_in_step=False)
    assert _settings(acc.engine) == ("raise", False, True)
    acc.engine.set_nonfinite_policy("skip")  # changed on the running engine
    acc.engine.cache_weight_casts = False
    acc.free_memory()
    assert _settings(acc.engine) == ("skip", False, False)
    once = pickle.loads(pickle.dumps(acc))
    twice = pickle.loads(pickle.dumps(once))  # pickled before its engine was ever built
    assert _settings(twice.engine) == ("skip", False, False)
    assert _settings(once.engine) == ("skip", False, False)
    model = torch.nn.Linear(2, 1)
    model, opt = twice.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    twice.backward(model(torch.ones(3, 2)).sum())
    opt.step()
    assert twice.last_step.stepped
