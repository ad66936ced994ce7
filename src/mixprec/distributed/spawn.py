"""Run a function in N local processes over Gloo on 127.0.0.1.

This is the one multi-process runner of the project: the test suite's harness
(``tests/distributed/harness.py``), :func:`mixprec.parity_check` and the notebook
launcher all use it.

Example::

    def _check_sum(state, value):              # module level, so `spawn` can pickle it
        return reduce(state, torch.tensor(value)).item()

    def test_sum():
        assert run_distributed(_check_sum, 2, args=(3,)) == [6, 6]

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
joins the default group through ``mixprec.distributed.init_distributed`` and calls
``fn(state, *args)``; the group is destroyed in ``finally``. The per-rank return values come
back in rank order. When a rank raises (or dies) the others are killed and its traceback is
raised here as :class:`RankFailedError`; past ``timeout`` seconds everything is killed and a
``TimeoutError`` names the ranks still running.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Optional

_KILL_GRACE_S = 2.0


class RankFailedError(AssertionError):
    """A rank of a :func:`run_distributed` job raised or died; ``rank`` says which."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago. Another process may take it before
    it is bound again: for a rendezvous, host the store instead
    (:func:`mixprec.distributed.rendezvous.host_store`, as :func:`run_distributed` does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, *, torch_agent: bool = False) -> dict:
    """The variables of rank ``rank`` joining the store its parent hosts at 127.0.0.1:``port``
    ([Note: a store bound where it is asked to listen] in src/mixprec/distributed/rendezvous.py);
    ``torch_agent``: torch's env:// rendezvous joins it too (a script that calls
    ``init_process_group`` itself, as under torchrun)."""
    from .rendezvous import agent_store_env

    return dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size), **agent_store_env(port, torch_agent=torch_agent))


def _child(fn, rank: int, world_size: int, port: int, args: tuple, env: dict, timeout: float, results) -> None:
    os.environ.update(env)
    os.environ.update(rank_env(rank, world_size, port))
    import torch

    from mixprec.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    state = None
    try:
        state = init_distributed(torch.device("cpu"), timeout=datetime.timedelta(seconds=timeout))
        # Plain pickle: torch's queue reducers would share tensor storage through file
        # descriptors that vanish when this process exits.
        value = pickle.dumps(fn(state, *args))
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if state is not None:
            destroy_distributed(state)


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    timeout: float = 120,
    env: Optional[dict] = None,
) -> list:
    """Run ``fn(state, *args)`` on ``world_size`` spawned ranks; return their results in rank order."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    from .rendezvous import host_store

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = host_store(timeout_s=timeout)  # the ranks join it; it lives until they are done
    port = store.port
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, tuple(args), dict(env or {}), timeout, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                rank, kind, payload = results.get(timeout=0.05)
            except queue.Empty:
                for rank, p in enumerate(procs):
                    # A rank that died without reporting (killed, os._exit, crash in C++).
                    if rank not in values and p.exitcode is not None:
                        time.sleep(0.2)  # its report may still be in flight
                        try:
                            r, kind, payload = results.get(timeout=0.5)
                        except queue.Empty:
                            raise RankFailedError(
                                rank, f"rank {rank} of {world_size} died with exit code {p.exitcode} "
                                f"without reporting a result (killed by a signal or os._exit?)"
                            ) from None
                        _record(values, r, kind, payload, world_size)
                        break
                if time.monotonic() > deadline:
                    running = [r for r in range(world_size) if r not in values]
                    raise TimeoutError(
                        f"run_distributed({getattr(fn, '__name__', fn)!r}) did not finish within "
                        f"timeout={timeout}s; rank(s) {running} still running (all ranks were killed). "
                        f"Look for a collective only some ranks call, or raise timeout="
                    )
                continue
            _record(values, rank, kind, payload, world_size)
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return [values[r] for r in range(world_size)]
    finally:
        _stop(procs)
        results.close()
        results.join_thread()
        del store


def _record(values: dict, rank: int, kind: str, payload: Any, world_size: int) -> None:
    if kind == "error":
        raise RankFailedError(rank, f"rank {rank} of {world_size} failed:\n{payload}")
    values[rank] = pickle.loads(payload)
