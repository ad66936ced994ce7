"""Experiment trackers behind ``Accelerator(log_with=...)``, ``init_trackers``, ``log``,
``get_tracker`` and ``end_training`` (Accelerate's API).

Built in:

* ``"jsonl"`` (no dependency, the default when ``log_with`` is not given): one JSON object
  per line in ``<project_dir>/<project_name>/metrics.jsonl``: ``{"step", "values"}`` rows,
  and a first ``{"config": ...}`` row when ``init_trackers`` got a config.
* ``"tensorboard"``: ``torch.utils.tensorboard.SummaryWriter`` in
  ``<project_dir>/<project_name>`` (needs the ``tensorboard`` package).
* ``"mlflow"``: a run in a local file store (``<project_dir>/mlruns`` unless
  ``MLFLOW_TRACKING_URI`` is set), experiment ``project_name``.
* ``"wandb"``: a ``wandb.init`` run (``mode`` from ``init_kwargs`` / ``WANDB_MODE``, e.g.
  ``"offline"``), project ``project_name``, files under ``project_dir``.

``log_with`` also takes tracker objects: anything with ``name``, ``store_init_configuration``,
``log`` and ``finish`` (Accelerate's ``GeneralTracker`` subclasses included), and ``"all"``
(every built-in tracker whose library is installed). Trackers run on the main process only.

Example::

    accelerator = Accelerator(log_with=["jsonl", "tensorboard"], project_dir="runs/exp1")
    accelerator.init_trackers("demo", config={"lr": 1e-3})
    accelerator.log({"loss": 0.25}, step=10)
    accelerator.end_training()       # finishes (flushes and closes) every tracker
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Optional, Union


class Tracker:
    """Base class of the built-in trackers (Accelerate's ``GeneralTracker`` interface)."""

    name = ""
    requires_logging_directory = True

    @property
    def tracker(self) -> Any:
        """The underlying library object (``get_tracker(name, unwrap=True)`` returns it)."""
        raise NotImplementedError

    def store_init_configuration(self, values: dict) -> None:
        raise NotImplementedError

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


def _plain(value: Any) -> Any:
    """A JSON-friendly version of a logged value (tensors and numpy scalars become numbers)."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else str(v)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


class JSONLTracker(Tracker):
    """Appends ``{"step": ..., "values": {...}}`` lines to ``<dir>/<run_name>/metrics.jsonl``."""

    name = "jsonl"

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"init_kwargs['jsonl'] has unknown keys {sorted(kwargs)}; the jsonl tracker takes none")
        self.path = Path(logging_dir) / run_name / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    @property
    def tracker(self):
        return self._file

    def _write(self, row: dict) -> None:
        if self._file.closed:
            raise ValueError(f"the jsonl tracker writing {self.path} was finished; call init_trackers() again")
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def store_init_configuration(self, values: dict) -> None:
        self._write({"config": _plain(values)})

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self._write({"step": step, "values": _plain(values)})

    def finish(self) -> None:
        self._file.close()


class TensorBoardTracker(Tracker):
    """``torch.utils.tensorboard.SummaryWriter``: numbers become scalars, strings text, dicts
    of numbers ``add_scalars``."""

    name = "tensorboard"

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = Path(logging_dir) / run_name
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, values: dict) -> None:
        plain = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
        self.writer.add_hparams(plain, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        for k, v in values.items():
            v = _plain(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, global_step=step, **kwargs)
            elif isinstance(v, str):
                self.writer.add_text(k, v, global_step=step, **kwargs)
            elif isinstance(v, dict):
                self.writer.add_scalars(k, v, global_step=step, **kwargs)
            else:
                raise TypeError(f"log(): the tensorboard tracker cannot log {k}={v!r}; give numbers, "
                                f"strings or dicts of numbers")
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class MLflowTracker(Tracker):
    """An MLflow run in a local file store (``<logging_dir>/mlruns``) unless
    ``MLFLOW_TRACKING_URI`` says otherwise."""

    name = "mlflow"

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (Path(logging_dir).resolve() / "mlruns").as_uri()
            # MLflow 3 refuses its file store unless asked for it explicitly: this tracker's
            # default is that local store, so it asks (set MLFLOW_TRACKING_URI to use another).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        experiment = mlflow.set_experiment(kwargs.pop("experiment_name", run_name))
        self.run = mlflow.start_run(experiment_id=experiment.experiment_id, **kwargs)
        self._mlflow = mlflow

    @property
    def tracker(self):
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        self._mlflow.log_params({k: str(v)[:6000] for k, v in values.items()})

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        metrics = {}
        for k, v in values.items():
            v = _plain(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[k] = v
            else:
                raise TypeError(f"log(): the mlflow tracker logs numbers only, got {k}={v!r}")
        self._mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        self._mlflow.end_run()


class WandBTracker(Tracker):
    """A ``wandb.init`` run; pass ``init_kwargs={"wandb": {"mode": "offline"}}`` to stay local."""

    name = "wandb"

    def __init__(self, run_name: str, logging_dir: Union[str, os.PathLike], **kwargs: Any) -> None:
        import wandb

        kwargs.setdefault("dir", str(logging_dir))
        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self):
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict, step: Optional[int] = None, **kwargs: Any) -> None:
        self.run.log({k: _plain(v) for k, v in values.items()}, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


BUILT_IN: dict[str, tuple[type, Optional[str]]] = {
    "jsonl": (JSONLTracker, None),
    "tensorboard": (TensorBoardTracker, "tensorboard"),
    "mlflow": (MLflowTracker, "mlflow"),
    "wandb": (WandBTracker, "wandb"),
}


def available(name: str) -> bool:
    module = BUILT_IN[name][1]
    return module is None or importlib.util.find_spec(module) is not None


def _is_tracker_object(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in ("store_init_configuration", "log", "finish")) and \
        isinstance(getattr(obj, "name", None), str)


def resolve_log_with(log_with: Any) -> list:
    """``log_with`` as a list of built-in names and tracker objects (checked now, so a typo
    fails at ``Accelerator(...)``, not at the first ``log``)."""
    if log_with is None:
        return ["jsonl"]
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    out: list = []
    for item in items:
        if _is_tracker_object(item):
            out.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()  # Accelerate's LoggerType is a str enum
        if name == "all":
            out.extend(n for n in BUILT_IN if available(n) and n not in out)
            continue
        if name not in BUILT_IN:
            raise ValueError(
                f"log_with={item!r} is not a tracker mixprec knows; use one of {sorted(BUILT_IN)}, 'all', "
                f"or an object with name, store_init_configuration(), log() and finish()"
            )
        if not available(name):
            raise ValueError(
                f"log_with={name!r} needs the {BUILT_IN[name][1]!r} package, which is not installed; "
                f"pip install {BUILT_IN[name][1]} (or use log_with='jsonl', which needs nothing)"
            )
        if name not in out:
            out.append(name)
    return out


def start_trackers(spec: list, project_name: str, logging_dir: Optional[str], config: Optional[dict],
                   init_kwargs: Optional[dict]) -> list:
    """Create the trackers ``spec`` names (main process only) and store ``config`` in each."""
    if not isinstance(project_name, str) or not project_name:
        raise ValueError(f"init_trackers(project_name={project_name!r}) needs a non-empty string")
    init_kwargs = dict(init_kwargs or {})
    unknown = [k for k in init_kwargs if k not in {n if isinstance(n, str) else n.name for n in spec}]
    if unknown:
        raise ValueError(f"init_kwargs has keys {unknown} that are not trackers in use "
                         f"({[n if isinstance(n, str) else n.name for n in spec]}); remove them")
    directory = logging_dir if logging_dir is not None else os.getcwd()
    trackers = []
    for item in spec:
        if isinstance(item, str):
            tracker = BUILT_IN[item][0](project_name, directory, **dict(init_kwargs.get(item, {})))
        else:
            tracker = item
        if config is not None:
            tracker.store_init_configuration(config)
        trackers.append(tracker)
    return trackers
