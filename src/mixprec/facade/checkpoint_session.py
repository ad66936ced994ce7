"""The checkpoint session: ``save_state`` / ``load_state`` of everything prepared (and the
objects registered with ``register_for_checkpointing``), checkpoint naming and rotation
(``project_config``: checkpoint/rotation.py), and the pre-hooks Accelerate scripts register.

The format and the collective writing and reading are checkpoint/state.py's; this concern
owns the run's side: which objects, which folder, the hooks, and the check that every rank
makes the same call (checkpoint/sync.py).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional

from ..checkpoint import rotation
from ..checkpoint.rotation import ProjectConfiguration, resolve_project_configuration
from ..checkpoint.state import load_accelerator_state, save_accelerator_state
from ..distributed import watchdog as desync


class RemovableHandle:
    """Returned by the ``register_*_hook`` methods; ``remove()`` unregisters the hook."""

    def __init__(self, hooks: "OrderedDict[int, Callable]", key: int) -> None:
        self._hooks = hooks
        self.id = key

    def remove(self) -> None:
        self._hooks.pop(self.id, None)


class CheckpointSession:
    """Mixin of :class:`mixprec.Accelerator`: owns ``project_configuration``,
    ``_checkpoint_objects`` and the hooks (``_save_hooks``, ``_load_hooks``, made with the
    other per-process objects in facade/lifetime.py)."""

    def _start_checkpoints(self, project_dir: Optional[str], project_config: Optional[ProjectConfiguration]) -> None:
        self.project_configuration = resolve_project_configuration(project_dir, project_config)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore these objects (anything with ``state_dict``/``load_state_dict``,
        e.g. an EMA or a custom counter) with every ``save_state``/``load_state``, in order."""
        bad = [o for o in objects if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:
            raise TypeError(
                f"register_for_checkpointing() got {[type(o).__name__ for o in bad]} without "
                "state_dict()/load_state_dict(); give objects that have both (wrap others in a small class)"
            )
        self._checkpoint_objects.extend(objects)

    @desync.tracked("save_state")
    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **save_model_func_kwargs) -> str:
        """Save models, optimizers, scaler, schedulers, RNG, dataloader positions and registered
        objects to ``output_dir`` (or the next ``checkpoint_<k>`` with automatic naming).

        Collective: every process calls it. Atomic: a crash leaves the previous checkpoint
        intact. Returns the directory written.

        Example::

            accelerator.save_state("ckpt/step_500")
        """
        if not safe_serialization or save_model_func_kwargs:
            raise ValueError(
                f"save_state(safe_serialization={safe_serialization!r}, {sorted(save_model_func_kwargs)}): mixprec "
                "checkpoints have one format (checksummed tensor files, docs/checkpointing.md) and no "
                "per-model save options; call save_state(output_dir) and use save_model() for exports"
            )
        self._call_check(self.state, "save_state")
        config = self.project_configuration
        automatic = output_dir is None and config.automatic_checkpoint_naming
        if output_dir is None and not automatic:
            raise ValueError(
                "save_state() needs output_dir=, or Accelerator(project_config=ProjectConfiguration("
                "project_dir=..., automatic_checkpoint_naming=True))"
            )
        target = config.checkpoints_dir / f"checkpoint_{config.iteration}" if automatic else Path(output_dir)
        save_accelerator_state(self, target, self._checkpoint_objects)
        self._run_save_hooks(str(target))
        if automatic:
            config.iteration += 1
            if self.is_main_process:
                rotation.rotate(config.checkpoints_dir, config.total_limit)
            self.wait_for_everyone()
        return str(target)

    @desync.tracked("load_state")
    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
                   **load_model_func_kwargs) -> str:
        """Restore what :meth:`save_state` wrote, into the prepared objects, whatever backend
        or world size saved it. Without ``input_dir`` (automatic naming) the newest complete
        checkpoint. Collective. A mismatch or a corrupt checkpoint raises and loads nothing.

        Accelerate's extra arguments: mixprec reads every non-tensor file with
        ``torch.load(weights_only=True)`` on the CPU and puts each tensor where the engine
        keeps it, so ``load_kwargs`` may only repeat that (``{}``, ``{"weights_only": True}``,
        ``{"map_location": "cpu"}``) and ``map_location=`` only be ``"cpu"`` or ``"on_device"``;
        anything else raises ``NotImplementedError`` naming it (a trusted class a file
        pickles: ``torch.serialization.add_safe_globals([cls])`` before ``load_state``).

        Example::

            accelerator.load_state("ckpt/step_500")
        """
        _check_load_kwargs(load_kwargs, load_model_func_kwargs)
        self._call_check(self.state, "load_state")
        config = self.project_configuration
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ValueError(
                    "load_state() needs input_dir=, or automatic_checkpoint_naming=True in project_config"
                )
            source = rotation.latest_checkpoint(config.checkpoints_dir)
        else:
            source = Path(input_dir)
        self._run_load_hooks(str(source))
        load_accelerator_state(self, source, self._checkpoint_objects)
        number = rotation.checkpoint_number(source)
        if config.automatic_checkpoint_naming and number is not None:
            config.iteration = number + 1
        return str(source)

    def register_save_state_pre_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(models, weights, output_dir)`` runs on every process at each
        :meth:`save_state`, after mixprec wrote the checkpoint and before it is reported
        complete (the directory exists, so the hook can add its own files).
        ``weights`` are the models' full state dicts. mixprec always saves every prepared
        model: a hook that removes items from ``models``/``weights`` gets a ValueError."""
        return self._add_hook(self._save_hooks, hook, "register_save_state_pre_hook")

    def register_load_state_pre_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(models, input_dir)`` runs on every process at each :meth:`load_state`, before
        the checkpoint is read (mixprec still loads every prepared model afterwards)."""
        return self._add_hook(self._load_hooks, hook, "register_load_state_pre_hook")

    @staticmethod
    def _add_hook(hooks: "OrderedDict[int, Callable]", hook: Callable, name: str) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"{name}() needs a callable, got {hook!r}")
        key = max(hooks, default=-1) + 1
        hooks[key] = hook
        return RemovableHandle(hooks, key)

    def _run_save_hooks(self, output_dir: str) -> None:
        if not self._save_hooks:
            return
        models = list(self._models)
        weights = [self.get_state_dict(m) for m in models]
        for hook in list(self._save_hooks.values()):
            hook(models, weights, output_dir)
        if len(models) != len(self._models) or len(weights) != len(self._models):
            raise ValueError(
                "a save_state pre-hook removed entries from models/weights to skip saving them; mixprec "
                "always saves every prepared model (the checkpoint is complete either way): leave the lists as they are"
            )

    def _run_load_hooks(self, input_dir: str) -> None:
        models = list(self._models)
        for hook in list(self._load_hooks.values()):
            hook(models, input_dir)
        if len(models) != len(self._models):
            raise ValueError(
                "a load_state pre-hook removed entries from models to skip loading them; mixprec always "
                "loads every prepared model: leave the list as it is"
            )


_READER_LOADS = {"weights_only": True, "map_location": "cpu"}  # what mixprec's checkpoint reader does


def _check_load_kwargs(load_kwargs: Optional[dict], model_kwargs: dict) -> None:
    """``load_state``'s Accelerate arguments: accepted where they ask for what mixprec's reader
    does anyway, refused naming them otherwise."""
    for key, value in (load_kwargs or {}).items():
        if _READER_LOADS.get(key, object()) != value:
            raise NotImplementedError(
                f"load_state(load_kwargs={{{key!r}: {value!r}}}): mixprec reads a checkpoint's non-tensor files "
                f"with torch.load(weights_only=True, map_location='cpu') and places each tensor itself; "
                f"{key}={value!r} is not supported. Drop it (for a class a trusted file pickles, call "
                f"torch.serialization.add_safe_globals([cls]) before load_state)"
            )
    for key, value in model_kwargs.items():
        if key != "map_location" or value not in ("cpu", "on_device", None):
            raise NotImplementedError(
                f"load_state({key}={value!r}): mixprec's engines restore the weights and optimizer state "
                f"onto the devices they keep them on themselves (Accelerate's map_location='cpu' or "
                f"'on_device' are accepted, as no-ops); drop {key}="
            )
