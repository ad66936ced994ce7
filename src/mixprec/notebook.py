"""Start a multi-process training function from a Jupyter notebook (or any interactive session).

Example (in a notebook cell)::

    from mixprec import Accelerator, notebook_launcher

    def train(steps):
        accelerator = Accelerator(mixed_precision="bf16", backend="zero2")
        ...                                     # your loop
        accelerator.end_training()
        return final_loss

    losses = notebook_launcher(train, args=(100,), num_processes=2)   # [rank 0's, rank 1's]

The processes are started with ``multiprocessing``'s *spawn* method by
:func:`mixprec.distributed.spawn.run_distributed` (fork would copy the kernel's threads and
any CUDA state, which deadlocks or fails later). Each rank gets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` and joins the default process group
before ``fn`` runs, so ``Accelerator()`` inside ``fn`` picks it up; it is torn down when
``fn`` returns, and every launch uses a fresh port, so the cell can be run again.

[Note: functions defined in a notebook]
A spawned process starts a fresh interpreter and unpickles what it is given. Plain pickle
stores a function *by reference* (``__main__.train``), and a spawned child can resolve that
only when it re-imports the parent's ``__main__`` - which it does for a script run as
``python train.py``, but a Jupyter kernel's ``__main__`` is not a file and cannot be
re-imported, so the child fails with "Can't get attribute 'train' on <module '__main__'>".
The launcher therefore pickles functions and classes defined in a non-importable
``__main__`` *by value*: the function's compiled code (``marshal``, which is safe because
the child runs the same interpreter), its defaults, closure and the globals its code names;
a class as its name, bases and attributes. They are rebuilt in the child's ``__main__``, so
functions and classes defined in other cells and used by ``fn`` come along. Everything else
(modules, torch objects, your library's classes) is pickled by reference as usual, and must
be importable in the child. What cannot be pickled - an open file, a lock, a live
``Accelerator`` captured as a global - is refused before any process starts, with the name of
the argument or global and the fix.

Rules, in short: define ``fn`` at the top level of a cell (or in a module); create the
``Accelerator``, model and data *inside* ``fn``; pass small picklable arguments.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import types
from typing import Any, Callable, Optional

from .distributed.spawn import RankFailedError, run_distributed
from .errors import MixprecError
from .notebook_pickle import by_value, code_global_names, dumps

__all__ = ["NotebookLaunchError", "notebook_launcher"]

_PG_BACKENDS = ("auto", "gloo", "nccl")


class NotebookLaunchError(MixprecError):
    """A rank of a :func:`notebook_launcher` run raised or died.

    ``rank`` names it; ``child_traceback`` is the traceback text printed in that process.
    """

    def __init__(self, rank: int, child_traceback: str) -> None:
        super().__init__(f"notebook_launcher: rank {rank} failed; its traceback:\n{child_traceback}")
        self.rank = rank
        self.child_traceback = child_traceback


_FIX = (
    "pass only picklable values (numbers, strings, tensors, plain containers, importable "
    "classes), and create the Accelerator, model, data and anything holding a file, lock, "
    "thread or process group inside the function"
)


def _check_picklable(fn: Callable, args: tuple) -> bytes:
    """Pickle ``(fn, args)`` for the children, or raise a TypeError naming what cannot be."""
    if not callable(fn):
        raise TypeError(f"notebook_launcher(fn={fn!r}): fn must be a function")
    try:
        return dumps((fn, tuple(args)))
    except Exception:  # noqa: BLE001 - pickle raises PicklingError, TypeError, AttributeError...
        pass
    # Find the culprit: the function (or a global it uses), or an argument.
    try:
        dumps(fn)
    except Exception as e:  # noqa: BLE001
        raise TypeError(_explain_function(fn, e)) from None
    for i, arg in enumerate(args):
        try:
            dumps(arg)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"notebook_launcher: args[{i}] ({type(arg).__module__}.{type(arg).__qualname__}) cannot be "
                f"pickled to send it to the spawned processes ({type(e).__name__}: {e}); {_FIX}"
            ) from None
    return dumps((fn, tuple(args)))  # raises the original error if only the pair fails


def _explain_function(fn: Callable, error: Exception) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    head = f"notebook_launcher: fn {name!r} cannot be pickled to send it to the spawned processes"
    if isinstance(fn, types.FunctionType) and by_value(fn):
        for key in sorted(code_global_names(fn.__code__)):
            if key in fn.__globals__ and not key.startswith("__"):
                try:
                    dumps(fn.__globals__[key])
                except Exception as e:  # noqa: BLE001
                    return (
                        f"{head}: it uses the global {key!r} ({type(fn.__globals__[key]).__qualname__}), which "
                        f"cannot be pickled ({type(e).__name__}: {e}). Create {key!r} inside the function "
                        f"(or pass what it needs as an argument); {_FIX}"
                    )
    if "<locals>" in name or "<lambda>" in name:
        return (
            f"{head} ({type(error).__name__}: {error}): it is nested in another function or a lambda "
            f"of an importable module; define it at the top level of a notebook cell or of a module"
        )
    return (
        f"{head} ({type(error).__name__}: {error}); define it at the top level of a notebook cell "
        f"or of an importable module, and {_FIX}"
    )


# ----------------------------------------------------------------------------- child side
def _run_in_child(state, payload: bytes, backend: str, port: Optional[int], timeout: float):
    """Runs in each rank (under :func:`run_distributed`): unpickle ``fn`` and call it."""
    import torch

    from .distributed import destroy_distributed, init_distributed

    if port is not None or backend == "nccl":
        # The runner joined a Gloo group on its own port; replace it by the one asked for,
        # so that Accelerator() finds the group it should use.
        destroy_distributed(state)
        if port is not None:  # rank 0 hosts the store there, as torch's env:// does
            from .distributed.rendezvous import HOSTED_STORE_ENV

            os.environ["MASTER_PORT"] = str(port)
            os.environ.pop(HOSTED_STORE_ENV, None)
        device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        state = init_distributed(device, timeout=datetime.timedelta(seconds=timeout))
    # The runner pins its ranks to one thread (right for tests); training gets a fair share.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // state.world_size))
    fn, args = pickle.loads(payload)
    try:
        return fn(*args)
    finally:
        # Engines hold C++ objects that keep the group alive; drop them before the
        # runner destroys it (an Accelerator the function did not end_training()).
        del fn, args
        gc.collect()


# ----------------------------------------------------------------------------- parent side
def _resolve_pg_backend(backend: str, num_processes: int) -> str:
    if backend not in _PG_BACKENDS:
        raise ValueError(
            f"notebook_launcher(backend={backend!r}): valid process-group backends are "
            f"{', '.join(map(repr, _PG_BACKENDS))} (the training backend - ddp, zero2, fsdp... - is "
            f"chosen by the Accelerator inside your function)"
        )
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= num_processes else "gloo"


def notebook_launcher(
    fn: Callable[..., Any],
    args: tuple = (),
    num_processes: int = 2,
    *,
    backend: str = "auto",
    master_port: Optional[int] = None,
    timeout: float = 24 * 3600.0,
    env: Optional[dict] = None,
) -> list:
    """Run ``fn(*args)`` in ``num_processes`` spawned processes; return their results.

    Args:
        fn: the training function. Define it at the top level of a cell (or import it);
            create the ``Accelerator`` inside it.
        args: positional arguments for ``fn``; they are pickled, which is checked before
            any process starts.
        num_processes: processes (ranks) to start, >= 1. Each gets ``RANK``,
            ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT``.
        backend: the *process-group* backend: ``"gloo"`` (CPU), ``"nccl"`` (one GPU per
            process) or ``"auto"`` (nccl when there is a GPU per process). The training
            backend (ddp, zero2, fsdp...) is the Accelerator's ``backend=``.
        master_port: rendezvous port on 127.0.0.1 (default: a free port, new at every launch).
        timeout: seconds the whole run may take (and the collective timeout); past it every
            process is killed and ``TimeoutError`` names the ranks still running.
        env: extra environment variables for the processes (e.g.
            ``{"MIXPREC_BACKEND": "zero2"}``); the notebook's own environment is inherited.

    Returns:
        The list of every rank's return value, in rank order (``result[0]`` is rank 0's).
        Return values travel back pickled: return numbers, lists, or CPU tensors.

    Raises:
        TypeError: before starting, when ``fn`` or an argument cannot be pickled (names it).
        NotebookLaunchError: when a rank raises or dies; carries its rank and traceback.
            The other ranks are stopped at once.

    Example::

        def train(lr):
            accelerator = Accelerator(backend="ddp")
            ...
            return loss.item()

        notebook_launcher(train, args=(3e-4,), num_processes=2)   # -> [0.41, 0.41]
    """
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ValueError(f"notebook_launcher(num_processes={num_processes!r}): give an int >= 1")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"notebook_launcher(args={args!r}): args must be a tuple of positional arguments, "
            f"e.g. args=({args!r},)"
        )
    if master_port is not None and (not isinstance(master_port, int) or not 0 < master_port < 65536):
        raise ValueError(f"notebook_launcher(master_port={master_port!r}): give a port in 1..65535 or None")
    if not timeout > 0:
        raise ValueError(f"notebook_launcher(timeout={timeout!r}): give a positive number of seconds")
    pg_backend = _resolve_pg_backend(backend, num_processes)
    payload = _check_picklable(fn, tuple(args))
    try:
        return run_distributed(
            _run_in_child, num_processes,
            args=(payload, pg_backend, master_port, float(timeout)),
            timeout=float(timeout),
            env=env,
        )
    except RankFailedError as e:
        text = str(e)
        _, _, tb = text.partition(" failed:\n")
        raise NotebookLaunchError(e.rank, tb or text) from None
