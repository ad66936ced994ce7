"""Rank-aware logging: log once from the main process, or from every rank, through ``logging``.

Example::

    from mixprec.logging import get_logger

    logger = get_logger(__name__)
    logger.info("epoch %d done", epoch)                          # main process only
    logger.info("my shard has %d samples", n, main_process_only=False)   # every rank
    logger.info("rank-ordered", main_process_only=False, in_order=True)  # rank 0, 1, ... in turn

Every record carries ``record.rank`` and ``record.world_size``, so a handler can show them::

    logging.basicConfig(format=mixprec.logging.RANK_FORMAT, level=logging.INFO)

The rank is read when a record is emitted: from the default process group when one is
initialised (``Accelerator()`` initialises it), else from the ``RANK``/``WORLD_SIZE``
environment variables a launcher sets, else 0 of 1. mixprec keeps no global state for it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, MutableMapping, Optional, Union

__all__ = ["RANK_FORMAT", "MultiProcessAdapter", "get_logger", "process_rank"]

#: A format string that shows the rank of each record.
RANK_FORMAT = "[rank %(rank)d/%(world_size)d] %(levelname)s %(name)s: %(message)s"


def process_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process (0, 1 outside a multi-process job)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass

    def env(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    return env("RANK", 0), env("WORLD_SIZE", 1)


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``logging.LoggerAdapter`` that logs on the main process only unless told otherwise.

    Every logging method (``debug``, ``info``, ``warning``, ``error``, ``exception``,
    ``critical``, ``log``) takes two extra keyword arguments:

    * ``main_process_only`` (default True): emit on rank 0 only; False: on every rank.
    * ``in_order`` (default False, with ``main_process_only=False``): ranks emit one after
      the other, rank 0 first (a barrier per rank; every rank must make the call).
    """

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]):
        rank, world_size = process_rank()
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        extra.setdefault("rank", rank)
        extra.setdefault("world_size", world_size)
        kwargs["extra"] = extra
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, main_process_only: bool = True,
            in_order: bool = False, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        rank, world_size = process_rank()
        kwargs.setdefault("stacklevel", 2)
        if main_process_only:
            if rank == 0:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        if not in_order or world_size == 1:
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "in_order=True needs the process group (it takes turns with a barrier); create the "
                "Accelerator first, or log with in_order=False"
            )
        for turn in range(world_size):
            if turn == rank:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
                for handler in self.logger.handlers:
                    handler.flush()
            dist.barrier()

    # LoggerAdapter's own helpers call self.log(level, ...) with stacklevel unset; the
    # explicit methods keep the caller's line in records (stacklevel 3: caller -> here -> log).
    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.ERROR, msg, *args, **kwargs)

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.ERROR, msg, *args, exc_info=exc_info, **kwargs)

    def critical(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stacklevel", 3)
        self.log(logging.CRITICAL, msg, *args, **kwargs)


def get_logger(name: str, log_level: Union[int, str, None] = None) -> MultiProcessAdapter:
    """A rank-aware logger named ``name`` (see :class:`MultiProcessAdapter`).

    ``log_level`` sets the underlying logger's level (default: from the environment variable
    ``MIXPREC_LOG_LEVEL`` when set, else left as configured).

    Example::

        logger = get_logger(__name__, log_level="INFO")
        logger.info("loss %.4f", loss)      # printed once, by rank 0
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"get_logger(name={name!r}): give a logger name, e.g. __name__")
    logger = logging.getLogger(name)
    level: Optional[Union[int, str]] = log_level if log_level is not None else os.environ.get("MIXPREC_LOG_LEVEL")
    if level is not None:
        if isinstance(level, str):
            level = level.upper()
            if not isinstance(logging.getLevelName(level), int):
                raise ValueError(
                    f"get_logger(log_level={level!r}): use DEBUG, INFO, WARNING, ERROR or CRITICAL"
                )
        logger.setLevel(level)
    return MultiProcessAdapter(logger, {})
