"""Where checkpoints go: project configuration, automatic naming, listing and rotation.

With ``automatic_checkpoint_naming=True`` checkpoints are ``<project_dir>/checkpoints/
checkpoint_<k>`` with ``k`` counting saves; beyond ``total_limit`` the oldest complete
ones are removed after each successful save. Only complete checkpoints (with their
``COMPLETE`` marker) are listed or loaded; interrupted saves never are.

Example::

    config = ProjectConfiguration("runs/a", automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(project_config=config)
    accelerator.save_state()                   # runs/a/checkpoints/checkpoint_0
    list_checkpoints("runs/a/checkpoints")     # [PosixPath('runs/a/checkpoints/checkpoint_0')]
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path
from typing import Optional

from .format import COMPLETE

_NAME = re.compile(r"^checkpoint_(\d+)$")


@dataclasses.dataclass(kw_only=True)
class ProjectConfiguration:
    """Where and how ``save_state``/``load_state`` name checkpoints.

    Attributes:
        project_dir: root folder of the run; checkpoints go to ``project_dir/checkpoints``.
        automatic_checkpoint_naming: ``save_state()``/``load_state()`` without a directory
            use ``checkpoint_<iteration>`` / the newest complete checkpoint.
        total_limit: keep at most this many complete automatic checkpoints (None: all).
        iteration: the number the next automatic checkpoint gets (advanced by saves and
            set by loads).
        collective_timeout_s: how long a rank waits for the others to reach a collective
            checkpoint call before raising (instead of hanging).
    """

    project_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.total_limit is not None and (not isinstance(self.total_limit, int) or self.total_limit < 1):
            raise ValueError(f"total_limit={self.total_limit!r} must be an int >= 1 or None")

    @property
    def checkpoints_dir(self) -> Path:
        if self.project_dir is None:
            raise ValueError("no project_dir: pass ProjectConfiguration(project_dir=...) or a directory")
        return Path(self.project_dir) / "checkpoints"


def list_checkpoints(folder) -> list:
    """Complete ``checkpoint_<k>`` directories in ``folder``, oldest (smallest k) first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    _restore_interrupted_overwrites(folder)
    found = []
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def _restore_interrupted_overwrites(folder: Path) -> None:
    """Put back checkpoints an overwrite killed between its two renames left hidden
    ([Note: interrupted overwrite] in checkpoint/writer.py), so they are listed."""
    from .writer import _TEMP, restore_moved_aside

    for p in list(folder.iterdir()):
        m = _TEMP.match(p.name)
        if m is not None and m["kind"] == "old":
            restore_moved_aside(folder / m["target"])


def latest_checkpoint(folder) -> Path:
    found = list_checkpoints(folder)
    if not found:
        raise ValueError(
            f"no complete checkpoint in {str(folder)!r}; save one first or pass load_state(<directory>)"
        )
    return found[-1]


def checkpoint_number(path) -> Optional[int]:
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def rotate(folder, total_limit: Optional[int]) -> list:
    """Remove the oldest complete checkpoints beyond ``total_limit``; returns the removed."""
    if total_limit is None:
        return []
    found = list_checkpoints(folder)
    removed = found[: max(0, len(found) - total_limit)]
    for p in removed:
        shutil.rmtree(p)
    return removed


def resolve_project_configuration(project_dir, config) -> ProjectConfiguration:
    """The Accelerator's configuration from its ``project_dir=`` and ``project_config=``."""
    if config is None:
        config = ProjectConfiguration(project_dir=project_dir)
    elif not isinstance(config, ProjectConfiguration):
        raise TypeError(f"project_config={config!r} must be a mixprec.checkpoint.ProjectConfiguration")
    elif project_dir is not None:
        if config.project_dir not in (None, str(project_dir)):
            raise ValueError(
                f"project_dir={project_dir!r} conflicts with project_config.project_dir="
                f"{config.project_dir!r}; give one of them"
            )
        config.project_dir = str(project_dir)
    if config.automatic_checkpoint_naming and config.project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming=True needs a project_dir: pass Accelerator(project_dir=...) "
            "or ProjectConfiguration(project_dir=...)"
        )
    return config
