"""What a clip of ``model.parameters()`` reads, without walking the module tree each step.

[Note: the clip shares the step plan]
``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` hands over a generator that,
once iterated, walks every submodule (11 ms a step for 1,281 modules here). When that
generator is ``nn.Module.parameters`` of a prepared model, not started, recursing, the
clip takes the model's parameter tuple instead, cached while no module anywhere registered
a parameter or a submodule since (torch's global registration hooks bump ``_VERSION``).
With that tuple the engine knows, once, whether the clip covers exactly the params its
optimizers step; if so, the norm is taken over the gradients the step plans already hold
([Note: the step plan] in kernels.py, one C++ call: ``_C.plans_l2_norm``), and the clip's
factor goes into the fused update ([Note: clip inside the update] in engines/base.py). The
Comm contract is kept: the engine hands ``clip_grads`` the parameters as a
:class:`PlannedParameters` (a tuple of them carrying the plans); the base Comm answers with
:class:`PlannedGrads`, whose norm its ``global_norm`` takes; a Comm that overrides either
hook is not given plans.
Python's work per clip is then O(optimizers + param groups).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Iterable, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules import module as _module
from .. import kernels

_VERSION = [0]  # bumped when any module registers a parameter or a submodule


def _bump(*_args) -> None:
    _VERSION[0] += 1


_module.register_module_parameter_registration_hook(_bump)
_module.register_module_module_registration_hook(_bump)

_PARAMETERS_CODE = nn.Module.parameters.__code__


class ClipSources:
    """The cached parameter tuples of an engine's prepared models, and which of them cover
    exactly the params of its optimizers."""

    def __init__(self) -> None:
        self._models: dict[int, weakref.ref] = {}
        self._tuples: dict[int, tuple[int, tuple]] = {}  # id(model) -> (version, params)
        self._covers: dict[tuple, bool] = {}

    def add_model(self, model: nn.Module) -> None:
        self._models[id(model)] = weakref.ref(model)
        self._tuples.pop(id(model), None)

    def parameters(self, parameters: Iterable[torch.Tensor]) -> Sequence[torch.Tensor]:
        """``parameters`` as a sequence: a prepared model's cached tuple when ``parameters``
        is its unstarted ``model.parameters()`` generator, else a list of what it yields."""
        if (inspect.isgenerator(parameters) and parameters.gi_code is _PARAMETERS_CODE
                and inspect.getgeneratorstate(parameters) == inspect.GEN_CREATED):
            local = parameters.gi_frame.f_locals
            model = local.get("self")
            ref = self._models.get(id(model))
            if ref is not None and ref() is model and local.get("recurse", True):
                cached = self._tuples.get(id(model))
                if cached is not None and cached[0] == _VERSION[0]:
                    return cached[1]
                params = tuple(parameters)
                self._tuples[id(model)] = (_VERSION[0], params)
                return params
        return parameters if isinstance(parameters, (list, tuple)) else list(parameters)

    def covers(self, params: Sequence[torch.Tensor], sources_of, optimizers: Sequence[torch.optim.Optimizer],
               plans: Sequence[object]) -> Optional[tuple]:
        """Whether the plans' gradients are the clip's: ``params`` (a cached tuple: same
        object while valid) map (``sources_of``: model param -> what the optimizer steps)
        onto every param of ``optimizers`` (whose current ``plans`` stand for their param
        lists), each stepped by one optimizer only. Returns the "outsiders" then: the
        params of ``params`` no optimizer steps, which must hold no gradient at a clip that
        uses the plans (checked in C++ at each clip: a frozen param can be unfrozen without
        notice); None when the plans cannot stand for the clip. Computed once per
        combination."""
        if not isinstance(params, tuple):
            return None
        key = (id(params), _VERSION[0], *map(id, plans))
        entry = self._covers.get(key)
        # The entry holds the objects its key names: alive, their ids cannot be reused.
        if entry is None or entry[1] is not params or any(a is not b for a, b in zip(entry[2], plans)):
            stepped_list = [id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]]
            stepped = set(stepped_list)
            clip = {id(sources_of(p)) for p in params}
            outsiders = tuple(p for p in params if id(sources_of(p)) not in stepped)
            # A param held by two optimizers would be counted by both plans' norms.
            covered = len(stepped) == len(stepped_list) and stepped <= clip
            if len(self._covers) > 64:
                self._covers.clear()
            entry = self._covers[key] = (outsiders if covered else None, params, tuple(plans))
        return entry[0]

    def drop(self) -> None:
        self._models.clear()
        self._tuples.clear()
        self._covers.clear()


class PlannedParameters(tuple):
    """A clip's parameters (a tuple of them, usable as such by any Comm) that carries the
    step plans holding exactly their gradients, the plans' sources and the params outside
    the plans (which must hold no gradient: checked in C++ with the norm)."""

    plans: list
    sources: list
    outsiders: tuple

    def __new__(cls, params, plans, sources=(), outsiders=()):
        self = super().__new__(cls, params)
        self.plans = plans
        self.sources = list(sources)
        self.outsiders = outsiders
        return self


class PlannedGrads:
    """What Comm.clip_grads returns for PlannedParameters: the plans' gradients, left in
    C++ (Comm.global_norm takes their norm in one call, ``_C.plans_l2_norm``, which first
    checks the sources and the outsiders, [Note: the plan's sources])."""

    __slots__ = ("plans", "sources", "outsiders")

    def __init__(self, plans, sources=(), outsiders=()) -> None:
        self.plans = plans
        self.sources = sources
        self.outsiders = outsiders


def plans_of(optimizers: Sequence[torch.optim.Optimizer], lowp_of) -> Optional[list]:
    """The current step plan of every optimizer, or None when one has none."""
    plans = []
    for opt in optimizers:
        plan = kernels.step_plan(opt, lowp_of)
        if plan is None:
            return None
        plans.append(plan)
    return plans
