"""An Accelerator's lifetime: its per-process objects, its engine (built again by
``free_memory()`` and after unpickling), pickling, and ``end_training()``.

[Note: pickling an Accelerator]
Accelerate pickles its Accelerator (multiprocessing, notebook paths). A mixprec one
pickles its settings: config, policy, state (its process group by name, see [Note:
pickling a state] in distributed/state.py), dataloader and scheduler options, project
configuration, trigger, and the engine spec (facade/run.py) with the engine's current
settings. The engine (C++ objects bound to the group), the prepared objects, registered
checkpoint objects and hooks, trackers and the desync watchdog are not pickled: the
unpickled Accelerator builds a fresh engine of the same kind at its first use (a collective
on a multi-process group: every rank uses it), prepares anew, and where its process group
does not exist (another job, a process without one) it raises a RuntimeError naming the fix
when it communicates, not when unpickled.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Optional

from .. import registry
from ..checkpoint.sync import CallCheck
from ..distributed import watchdog as desync
from ..distributed.state import DetachedGroup, destroy_distributed
from ..engines import Engine
from ..gradient_state import GradientState
from ..parallel import tensor as tensor_parallel
from ..wrappers.model import AutocastGate
from .preparation import PreparedObjects


class Lifetime:
    """Mixin of :class:`mixprec.Accelerator`: see the module docstring. Owns ``engine``,
    ``_engine_spec``, ``_ended`` and the per-process objects :meth:`_start_process_objects`
    makes (in __init__ and when unpickled)."""

    _join = None  # the running join_uneven_inputs block (mixprec/join.py)
    _NOT_PICKLED = ("_join", "_dispatch_group", "engine", "_engine", "_watchdog", "_models", "_optimizers",
                    "_schedulers", "_dataloaders", "prepared", "trackers", "_checkpoint_objects", "_save_hooks",
                    "_load_hooks", "_no_sync_depth", "_progress", "_autocast_gate", "_call_check", "gradient_state",
                    "_ulysses", "_policy_logged", "_ended")

    def _start_process_objects(self, accumulation_steps: int, sync_each_batch: bool,
                               collective_timeout_s: Optional[float]) -> None:
        """What lives in this process only: the accumulation state, the prepared objects'
        lists, registered checkpoint objects and hooks, trackers, the progress tracker."""
        self.gradient_state = GradientState(accumulation_steps)
        self.gradient_state.sync_each_batch = sync_each_batch
        self._ended = False
        self._policy_logged = False
        self._autocast_gate = AutocastGate()
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        # The public view of the same (live) lists, for checkpointing and tools.
        self.prepared = PreparedObjects(self._models, self._optimizers, self._schedulers, self._dataloaders)
        self.trackers: list = []
        self._checkpoint_objects: list[Any] = []  # registered with register_for_checkpointing
        self._save_hooks: dict = {}  # register_save_state_pre_hook
        self._load_hooks: dict = {}  # register_load_state_pre_hook
        self._no_sync_depth: dict[int, int] = {}  # id(model) -> open no_sync blocks
        self._progress = None  # the running progress() tracker (progress.py)
        self._call_check = CallCheck(collective_timeout_s)
        self._dispatch_group = None  # made at the first dispatched prepare_data_loader

    def _start_watchdog(self, collective_timeout: Optional[float]) -> None:
        """Collective desync detection ([Note: desync detection] in distributed/watchdog.py)."""
        self._watchdog = desync.Watchdog.create(self.state, collective_timeout)
        if self._watchdog is not None:
            # A dropped Accelerator must not leave its thread polling the store for the
            # life of the process (a script or a test that builds several in turn).
            weakref.finalize(self, self._watchdog.abandon)

    # ------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        if self.mesh is not None:
            raise TypeError(
                "an Accelerator under tensor or sequence parallelism cannot be pickled: its rank mesh holds "
                "process subgroups that another process cannot find again; pickle the settings you need instead"
            )
        out = {k: v for k, v in self.__dict__.items() if k not in self._NOT_PICKLED}
        engine = self.__dict__.get("_engine")
        spec = self._engine_spec if engine is None else self._engine_spec.following(engine)
        out["_engine_spec"] = spec.with_group(None)
        gs = self.gradient_state
        out["_unpickled"] = {"accumulation_steps": gs.accumulation_steps, "sync_each_batch": gs.sync_each_batch,
                             "collective_timeout_s": self._call_check.timeout_s}
        return out

    def __setstate__(self, values: dict) -> None:
        values = dict(values)
        extra = values.pop("_unpickled")
        self.__dict__.update(values)
        self._watchdog = None
        self._ulysses = None
        self._start_process_objects(extra["accumulation_steps"], extra["sync_each_batch"],
                                    extra["collective_timeout_s"])
        registry.register(self)

    # ------------------------------------------------------------ the engine
    @property
    def engine(self) -> Engine:
        """The engine of this Accelerator's backend (built at first use after unpickling)."""
        engine = self.__dict__.get("_engine")
        if engine is None:
            engine = self._engine_after_unpickling()
        return engine

    @engine.setter
    def engine(self, value: Engine) -> None:
        self.__dict__["_engine"] = value

    def _engine_after_unpickling(self) -> Engine:
        if "_engine_spec" not in self.__dict__:
            raise AttributeError("engine: this Accelerator's __init__ did not finish")
        spec = self._engine_spec
        if spec.comm.distributed:
            group = self.state.group
            if isinstance(group, DetachedGroup):
                group.rank()  # the RuntimeError naming the fix
            if group is None:
                raise RuntimeError(f"this unpickled Accelerator's {spec.comm.name} engine has no process group; "
                                   f"make a new Accelerator in this process")
            spec = spec.with_group(group)
        engine = spec.build(self.policy, self.device)
        self._engine_spec = spec
        self.engine = engine
        registry.LIVE.add(self)
        return engine

    def _renew_engine(self) -> None:
        """free_memory(): a fresh engine of the same kind, the old one's buffers released."""
        old = self.engine
        old.release()
        self.engine = self._engine_spec.following(old).build(self.policy, self.device)
        if self._tp:
            for layout in filter(None, map(tensor_parallel.layout_of, self._models)):
                tensor_parallel.attach(self.engine, layout, self.state.group.group_name)
        self.gradient_state.step, self.gradient_state.sync_gradients = 0, True

    @property
    def _tp(self) -> bool:
        return self.mesh is not None and self.mesh.tp_size > 1

    @property
    def backend(self) -> str:
        engine = self.__dict__.get("_engine")  # an unpickled Accelerator builds its engine at first use
        return engine.name if engine is not None else self._engine_spec.comm.name

    def end_training(self) -> None:
        """Tear down the process group this Accelerator initialised.

        The engine first drops its C++ objects that hold the group (reducers, sharding
        cores): a group destroyed here but kept alive by them would only be torn down at
        interpreter exit, where Gloo aborts ("terminate called without an active exception").
        """
        self._finish_trackers()
        self._ended = True
        if self._watchdog is not None:
            self._watchdog.stop()
        self.engine.release()
        gc.collect()
        destroy_distributed(self.state)
