"""Accelerate's Accelerator methods that sit beside mixprec's own: process decorators,
trackers, triggers, ``save``, ``skip_first_batches``, ``free_memory`` (the checkpoint
pre-hooks are the checkpoint session's, src/mixprec/facade/checkpoint_session.py).

:class:`mixprec.Accelerator` inherits them from :class:`AccelerateApi`; they only use the
Accelerator's public state (``state``, ``gradient_state``, the prepared objects).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .. import tracking
from ..distributed import collectives
from .options import DistributedType

if TYPE_CHECKING:
    from .state import AcceleratorState


def _only_when(predicate: Callable[[], bool], function: Optional[Callable], name: str):
    if function is None:  # used as @accelerator.on_main_process() with parentheses
        return lambda f: _only_when(predicate, f, name)
    if not callable(function):
        raise TypeError(f"{name}() decorates a function, got {function!r}")

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if predicate():
            return function(*args, **kwargs)
        return None

    return wrapper


class AccelerateApi:
    """Mixin of :class:`mixprec.Accelerator` (see the module docstring)."""

    state: "AcceleratorState"

    # ------------------------------------------------------------------ processes
    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for the setup (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``)."""
        return self.state.distributed_type

    @property
    def use_distributed(self) -> bool:
        return self.state.world_size > 1

    @property
    def multi_device(self) -> bool:
        """Accelerate's: several processes with a device each under plain data parallelism
        (``MULTI_GPU``); False on one process, on CPUs and on the sharding engines (``FSDP``)."""
        return self.use_distributed and self.distributed_type == DistributedType.MULTI_GPU

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in its tensor-parallel group (0 without tensor parallelism, as
        Accelerate answers when TP is configured but off)."""
        mesh = getattr(self, "mesh", None)
        return 0 if mesh is None else mesh.tp_rank

    @property
    def pipeline_parallel_rank(self) -> int:
        """Raises NotImplementedError, as Accelerate's does: no pipeline parallelism."""
        raise NotImplementedError("pipeline_parallel_rank: pipeline parallelism is not supported (as in Accelerate)")

    @property
    def context_parallel_rank(self) -> int:
        """Raises NotImplementedError, as Accelerate's does: no ring context parallelism (mixprec's
        long-sequence split is sequence parallelism: docs/sequence_parallel.md)."""
        raise NotImplementedError(
            "context_parallel_rank: context parallelism is not supported (as in Accelerate); mixprec splits long "
            "sequences with sequence parallelism (docs/sequence_parallel.md)"
        )

    @property
    def parallelism_config(self) -> None:
        """Accelerate's ``ParallelismConfig`` (its TP/CP/SP meshes): always None here.
        mixprec's tensor and sequence parallelism are its own config keys
        (docs/tensor_parallel.md); code that reads this (transformers' Trainer) then takes
        the sizes as 1 and leaves the splitting to mixprec's engines."""
        return None

    @property
    def scaler(self) -> None:
        """Accelerate's ``torch.amp.GradScaler``: always None here. mixprec's fp16 loss
        scaling lives in the engine (``loss_scale``, ``skipped_steps``) and is saved by
        ``save_state``, so callers that save a GradScaler's state themselves find none."""
        return None

    @property
    def project_dir(self) -> Optional[str]:
        """``project_configuration.project_dir``, as in Accelerate."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> Optional[str]:
        """Where the trackers write: ``project_dir`` (Accelerate's ``logging_dir`` defaults to
        it; mixprec's ProjectConfiguration has no separate one). None without a project_dir
        (the trackers then write in the current directory)."""
        return self.project_configuration.project_dir

    @property
    def save_iteration(self) -> int:
        """``project_configuration.iteration``: the number the next automatic checkpoint gets."""
        return self.project_configuration.iteration

    @property
    def is_last_process(self) -> bool:
        return self.state.rank == self.state.world_size - 1

    def on_main_process(self, function: Optional[Callable] = None):
        """Decorator: run ``function`` on the main process only (None elsewhere)."""
        return _only_when(lambda: self.state.rank == 0, function, "on_main_process")

    def on_local_main_process(self, function: Optional[Callable] = None):
        """Decorator: run ``function`` on each node's main process only."""
        return _only_when(lambda: self.state.local_rank == 0, function, "on_local_main_process")

    def on_last_process(self, function: Optional[Callable] = None):
        """Decorator: run ``function`` on the last process only."""
        return _only_when(lambda: self.is_last_process, function, "on_last_process")

    def on_process(self, function: Optional[Callable] = None, process_index: Optional[int] = None):
        """Decorator: run ``function`` on process ``process_index`` only."""
        self._check_index(process_index, self.state.world_size, "process_index")
        return _only_when(lambda: self.state.rank == process_index, function, "on_process")

    def on_local_process(self, function: Optional[Callable] = None, local_process_index: Optional[int] = None):
        """Decorator: run ``function`` on local process ``local_process_index`` of each node."""
        self._check_index(local_process_index, self.state.local_world_size, "local_process_index")
        return _only_when(lambda: self.state.local_rank == local_process_index, function, "on_local_process")

    @staticmethod
    def _check_index(index: Any, size: int, name: str) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < size:
            raise ValueError(f"{name}={index!r} must be an int in 0..{size - 1} (there are {size} processes)")

    # ------------------------------------------------------------------ triggers
    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` on every process sees it
        (e.g. stop training when one rank finds a nan)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """Collective: True on every process if any process called :meth:`set_trigger` since
        the last check (the flags are then reset)."""
        flag = torch.tensor([1.0 if getattr(self, "_trigger", False) else 0.0], device=self.state.device)
        total = collectives.reduce(self.state, flag, "sum")
        if total.item() >= 1:
            self._trigger = False
            return True
        return False

    # ------------------------------------------------------------------ trackers
    def init_trackers(self, project_name: str, config: Optional[dict] = None, init_kwargs: Optional[dict] = None) -> None:
        """Start the trackers ``log_with`` named (main process only), storing ``config`` as the
        run's hyper-parameters. ``init_kwargs={"wandb": {...}}`` goes to each tracker's init."""
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"init_trackers(config={config!r}) must be a dict of hyper-parameters")
        if self.state.rank != 0:
            return
        self._finish_trackers()
        self.trackers = tracking.start_trackers(
            self._log_with, project_name, self.project_configuration.project_dir, config, init_kwargs
        )

    def log(self, values: dict, step: Optional[int] = None, log_kwargs: Optional[dict] = None) -> None:
        """Log ``values`` (name -> number/string) at ``step`` to every tracker (main process
        only). ``log_kwargs={"tensorboard": {...}}`` goes to that tracker's log call. Before
        :meth:`init_trackers` it does nothing when ``log_with`` was not given (Accelerate's
        behaviour) and raises when it was."""
        if not isinstance(values, dict):
            raise TypeError(f"log(values={values!r}) must be a dict of name -> value")
        if self.state.rank != 0:
            return
        if not self.trackers and self._log_with_given:
            # Without log_with, log() before init_trackers() is a no-op, as in Accelerate.
            raise RuntimeError(f"log() before init_trackers(): log_with={self._log_with_given!r} asks for "
                               f"trackers; call accelerator.init_trackers(project_name) first")
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called ``name`` (its library object with ``unwrap=True``). On other
        processes than the main one, and when there is none, raises ValueError."""
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        where = "" if self.state.rank == 0 else f" (process {self.state.rank}: trackers live on the main process)"
        raise ValueError(f"no tracker named {name!r}{where}; started: {[t.name for t in self.trackers]}")

    def _finish_trackers(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish()

    # ------------------------------------------------------------------ saving
    def save(self, obj: Any, f, safe_serialization: bool = False) -> None:
        """Write ``obj`` to ``f`` on the main process (``torch.save``; with
        ``safe_serialization=True`` a dict of tensors as safetensors)."""
        from ..engines.gathered import refuse_ungathered_save

        if self.state.rank != 0:
            return
        refuse_ungathered_save(obj, "accelerator.save")  # before a file is opened
        if safe_serialization:
            from safetensors.torch import save_file

            if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
                raise TypeError("save(safe_serialization=True) writes a dict of name -> tensor; use "
                                "safe_serialization=False (torch.save) for other objects")
            save_file({k: v.detach().contiguous().cpu() for k, v in obj.items()}, os.fspath(f),
                      metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    # ------------------------------------------------------------------ data
    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """A dataloader that skips the first ``num_batches`` batches of each pass over the
        prepared ``dataloader`` (e.g. to resume mid-epoch); the skipped batches are loaded and
        dropped. Use the original loader again for the following epochs.

        After :meth:`load_state` (Accelerate's resume idiom) the pass is the checkpointed
        pass's order from batch ``num_batches`` on, and the original loader's next pass is the
        next order: the uninterrupted run's batches (src/mixprec/wrappers/dataloader.py)."""
        from ..wrappers.dataloader import skip_first_batches

        return skip_first_batches(dataloader, num_batches)

    # ------------------------------------------------------------------ sync
    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module):
        """Make the backward inside synchronise gradients, after forwards run under
        :meth:`no_sync`. In mixprec a backward's synchronisation is decided when it runs (not
        at forward time as in torch DDP), so any backward outside ``no_sync`` already syncs:
        this checks ``model`` was prepared and that no ``no_sync`` of it is open."""
        if model not in self._models:
            raise ValueError(f"trigger_sync_in_backward() got a model this accelerator did not prepare: "
                             f"{type(model).__name__}")
        if self._no_sync_depth.get(id(model), 0):
            raise RuntimeError(
                "trigger_sync_in_backward() inside accelerator.no_sync(model): mixprec decides synchronisation "
                "when backward runs, so leave the no_sync block and call backward there (forwards run "
                "under no_sync are fine)"
            )
        yield

    # ------------------------------------------------------------------ memory
    def free_memory(self, *objects: Any) -> list:
        """Forget every prepared model, optimizer, scheduler and dataloader (the engine's fp32
        masters, gradient buffers and optimizer state go with them) and run the garbage
        collector; returns ``[None] * len(objects)`` for ``a, b = accelerator.free_memory(a, b)``.
        Prepare new objects afterwards as usual."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._renew_engine()
        objects = [None] * len(objects)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return objects

    def clear(self, *objects: Any) -> list:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)
