"""The test suite's multi-process harness: mixprec's own local process runner, on warm ranks.

``run_distributed(fn, world_size, args=...)`` runs ``fn(state, *args)`` on ``world_size`` ranks
over Gloo and returns their results in rank order, with the semantics of the public
``mixprec.distributed.spawn.run_distributed`` (same errors, same messages, same timeout). The
difference is where the ranks live: starting a spawned interpreter that imports torch and
mixprec costs seconds per rank on a loaded machine, more than most tests' work, so the ranks
here are kept warm between calls, one pool of ``world_size`` worker processes per world size,
for the pytest session ([Note: warm ranks] below). ``fresh=True`` starts fresh processes
through ``mixprec.distributed.spawn.run_distributed`` instead, for a test that needs a
process nobody used before; ``MIXPREC_TEST_FRESH_RANKS=1`` in the environment does that for
every call (to compare timings, or to rule the pool out when a test misbehaves).

[Note: warm ranks]
Each call sends ``fn`` and ``args`` (plain pickle) to every worker with the parent's current
environment, working directory and ``sys.path`` (what a freshly spawned rank would inherit),
plus ``env=`` and the rank variables. The worker joins a new default process group on a new
port, runs ``fn``, reports, then tears down what the call left, as a process exit would:
Accelerators still alive are ended (watchdog stopped, engine released, see [Note: shutdown
without end_training] in src/mixprec/accelerator.py), the process group is destroyed, mixprec's
per-process counters and state registry are reset (src/mixprec/distributed/watchdog.py, src/mixprec/accelerator.py,
src/mixprec/compat/state.py),
and torch/random/numpy RNG states, default dtype, grad mode, autocast, deterministic mode,
matmul precision, thread count, warnings filters, logging, signal handlers and environment are
put back to what they were when the worker started (tqdm's monitor thread is stopped; an
Accelerator the call dropped stopped its watchdog thread when it was collected). It then says whether it is clean; a
worker that cannot say so (a thread the call started still runs, teardown failed, or no
answer within ``_READY_TIMEOUT_S``) is replaced with its whole pool before the next call.

Failures: a rank that raises, dies or outlives ``timeout`` makes the call fail exactly as with
fresh processes (RankFailedError / TimeoutError naming the ranks), and the pool is killed and
replaced at the next call, so a killed, hung or ``os._exit``-ed rank never reaches another
test.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
from typing import Any, Callable, Optional

from mixprec.distributed import spawn as _spawn
from mixprec.distributed.rendezvous import host_store
from mixprec.distributed.spawn import RankFailedError, free_port, rank_env

__all__ = ["RankFailedError", "close_pools", "free_port", "hosted_store", "launch_two_nodes", "rank_env",
           "retry_on_port_taken", "run_distributed", "run_script_ranks"]


def run_script_ranks(argv: list, world: int, *, env: Optional[dict] = None, cwd=None, timeout: float = 300,
                     what: str = "rank") -> list:
    """Run ``argv`` (a whole script, as torchrun would) as ``world`` ranks joining a store this
    process hosts (torch's env:// and mixprec alike); fail naming every rank that exited
    non-zero; return the ranks' combined stdout/stderr."""
    import subprocess

    procs, outputs = [], []
    with hosted_store() as port:
        for rank in range(world):
            e = dict(os.environ, **(env or {}), **rank_env(rank, world, port, torch_agent=True), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(argv, env=e, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=timeout)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(f"{what} {r} of {argv[1:]} exited {procs[r].returncode}:\n{outputs[r][-3000:]}"
                                 for r in failed)
    return outputs


def launch_two_nodes(script_and_args: list, timeout: float = 120) -> tuple:
    """``mixprec launch --nnodes 2 --nproc-per-node 1`` on loopback, nodes 0 and 1 at once, each
    running ``script_and_args`` (with a fresh port when node 0's was taken first:
    ``retry_on_port_taken``); returns ([exit codes], [(stdout, stderr)]) of nodes 0 and 1."""
    import subprocess

    def run(port):
        common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
        procs = [subprocess.Popen([sys.executable, "-m", "mixprec", "launch", *common, "--node-rank", str(n),
                                   *script_and_args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for n in (0, 1)]
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        return [p.returncode for p in procs], outs

    return retry_on_port_taken(run)


def retry_on_port_taken(run, tries: int = 3):
    """``run(port)`` for a run whose port must be fixed in advance (a multi-node launch: every
    node is given node 0's port), which another process may take before node 0 binds it: when
    ``repr`` of the result shows EADDRINUSE, again with a new port, up to ``tries`` times."""
    for _ in range(tries - 1):
        result = run(str(free_port()))
        if "Address already in use" not in repr(result):
            return result
    return run(str(free_port()))


@contextlib.contextmanager
def hosted_store(timeout_s: float = 900.0):
    """For a test that starts its rank processes itself: a rendezvous store hosted by this
    process on 127.0.0.1 at a port bound once; yields the port. Each rank's environment is
    ``rank_env(rank, world_size, port)`` ([Note: a store bound where it is asked to listen]
    in src/mixprec/distributed/rendezvous.py)."""
    store = host_store(timeout_s=timeout_s)
    try:
        yield store.port
    finally:
        del store

_READY_TIMEOUT_S = 60.0  # a worker's teardown after a call; longer means a stuck rank: replaced
_START_TIMEOUT_S = 600.0  # a new worker's imports (minutes on a loaded 2-core machine)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    timeout: float = 120,
    env: Optional[dict] = None,
    fresh: bool = False,
) -> list:
    """Run ``fn(state, *args)`` on ``world_size`` ranks; return their results in rank order.

    Warm pooled ranks by default ([Note: warm ranks]); ``fresh=True`` spawns new processes
    (``mixprec.distributed.spawn.run_distributed``)."""
    if fresh or os.environ.get("MIXPREC_TEST_FRESH_RANKS") == "1":
        return _spawn.run_distributed(fn, world_size, args=args, timeout=timeout, env=env)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    pool = _pool(world_size)
    try:
        return pool.run(fn, tuple(args), dict(env or {}), timeout)
    except BaseException:
        _discard(world_size)
        raise


# ---------------------------------------------------------------------------------- parent
_POOLS: dict[int, "_Pool"] = {}


def _pool(world_size: int) -> "_Pool":
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.ready(_READY_TIMEOUT_S):
        _discard(world_size)
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
        # The call's timeout starts once the ranks have imported torch and mixprec.
        if not pool.ready(_START_TIMEOUT_S):
            _discard(world_size)
            raise RuntimeError(f"the {world_size} warm rank processes did not start (their stderr is above)")
    return pool


def _discard(world_size: int) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close()


def close_pools() -> None:
    """Stop every warm worker (end of the pytest session; also registered with atexit)."""
    for world_size in list(_POOLS):
        _discard(world_size)


atexit.register(close_pools)


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.procs, self.conns = [], []
        self.owes_ready = True  # the workers still have to report their start-up or teardown
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(theirs,), name=f"warm{world_size}-rank{rank}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)

    def ready(self, timeout: float) -> bool:
        """All workers alive and clean after start-up or the previous call."""
        if any(not p.is_alive() for p in self.procs):
            return False
        if not self.owes_ready:
            return True
        deadline = time.monotonic() + timeout
        for conn in self.conns:
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    return False
                if pickle.loads(conn.recv_bytes()) != "clean":
                    return False
            except (EOFError, OSError):
                return False
        self.owes_ready = False
        return True

    def run(self, fn, args: tuple, env: dict, timeout: float) -> list:
        # The parent hosts the job's store on a port bound once: no rank races another
        # process for it ([Note: a store bound where it is asked to listen]).
        store = host_store(timeout_s=timeout)
        try:
            return self._run(store.port, fn, args, env, timeout)
        finally:
            del store

    def _run(self, port: int, fn, args: tuple, env: dict, timeout: float) -> list:
        world_size = self.world_size
        job = (fn, args, dict(os.environ), env, os.getcwd(), list(sys.path), world_size, port, timeout)
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self.conns):
            conn.send_bytes(pickle.dumps((rank, job)))
        self.owes_ready = True
        values: dict[int, Any] = {}
        waiting = {rank: (self.conns[rank], self.procs[rank]) for rank in range(world_size)}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"run_distributed({getattr(fn, '__name__', fn)!r}) did not finish within "
                    f"timeout={timeout}s; rank(s) {sorted(waiting)} still running (all ranks were killed). "
                    f"Look for a collective only some ranks call, or raise timeout="
                )
            handles = [h for conn, p in waiting.values() for h in (conn, p.sentinel)]
            ready = mp.connection.wait(handles, timeout=min(left, 1.0))
            for rank, (conn, p) in sorted(waiting.items()):
                if conn in ready or (p.sentinel in ready and conn.poll(0.5)):
                    try:
                        kind, payload = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        kind, payload = "died", None
                    if kind == "ok":
                        values[rank] = pickle.loads(payload)
                        del waiting[rank]
                        continue
                    if kind == "error":
                        raise RankFailedError(rank, f"rank {rank} of {world_size} failed:\n{payload}")
                if p.sentinel in ready or not p.is_alive():
                    p.join(1.0)
                    raise RankFailedError(
                        rank, f"rank {rank} of {world_size} died with exit code {p.exitcode} "
                        f"without reporting a result (killed by a signal or os._exit?)"
                    )
        return [values[r] for r in range(world_size)]

    def close(self) -> None:
        _spawn._stop(self.procs)
        for conn in self.conns:
            conn.close()


# ---------------------------------------------------------------------------------- worker
def _serve(conn) -> None:
    """A warm rank: run jobs until the parent closes the pipe ([Note: warm ranks])."""
    import gc

    import torch

    import mixprec.accelerator  # noqa: F401 - the import a rank pays once

    torch.set_num_threads(1)
    saved = _Saved()
    # The objects of the imports above live as long as the worker: keep them out of every
    # later collection (the teardown's gc.collect() then takes milliseconds, not a second).
    gc.collect()
    gc.freeze()
    conn.send_bytes(pickle.dumps("clean"))
    while True:
        try:
            rank, job = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        reply = _call(rank, job)
        ok = reply[0] == "ok"
        conn.send_bytes(pickle.dumps(reply))
        del job, reply
        if not ok:
            # The parent kills this pool; a peer may be stuck in a collective with us.
            return
        clean = _teardown(saved)
        conn.send_bytes(pickle.dumps("clean" if clean else "dirty"))


def _call(rank: int, job: tuple):
    import datetime

    import torch

    from mixprec.distributed import init_distributed

    try:
        fn, args, environ, env, cwd, path, world_size, port, timeout = job
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(env)
        os.environ.update(rank_env(rank, world_size, port))
        os.chdir(cwd)
        sys.path[:] = path
        state = init_distributed(torch.device("cpu"), timeout=datetime.timedelta(seconds=timeout))
        return ("ok", pickle.dumps(fn(state, *args)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        return ("error", traceback.format_exc())


class _Saved:
    """What a fresh rank starts with, to put back after every call."""

    _SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGHUP")

    def __init__(self) -> None:
        import logging
        import random
        import signal
        import threading
        import warnings

        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.torch_rng = torch.get_rng_state()
        self.random = random.getstate()
        self.numpy = None
        if "numpy" in sys.modules:
            self.numpy = sys.modules["numpy"].random.get_state()
        self.dtype = torch.get_default_dtype()
        self.autocast_dtype = torch.get_autocast_dtype("cpu")
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.matmul = torch.get_float32_matmul_precision()
        self.anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self.warnings = list(warnings.filters)
        self.loggers = {name: self._logger_state(logging.getLogger(name or None)) for name in ("", "mixprec")}
        self.signals = {s: signal.getsignal(getattr(signal, s)) for s in self._SIGNALS if hasattr(signal, s)}
        self.threads = set(threading.enumerate())

    @staticmethod
    def _logger_state(logger):
        return logger, logger.level, list(logger.handlers), logger.propagate, logger.disabled

    def restore(self) -> bool:
        """Put everything back; False when a thread the call started is still running."""
        import logging
        import random
        import signal
        import threading
        import warnings

        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.random)
        if "numpy" in sys.modules:
            np_random = sys.modules["numpy"].random
            if self.numpy is None:
                np_random.seed(None)  # what a fresh import would do
            else:
                np_random.set_state(self.numpy)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.set_autocast_enabled("cpu", False)
        torch.set_autocast_dtype("cpu", self.autocast_dtype)
        torch.clear_autocast_cache()
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            # Only when changed: the setter imports torch._inductor (seconds).
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_float32_matmul_precision(self.matmul)
        torch.set_anomaly_enabled(*self.anomaly)
        torch.set_num_threads(1)
        warnings.filters[:] = self.warnings
        getattr(warnings, "_filters_mutated", lambda: None)()
        for logger, level, handlers, propagate, disabled in self.loggers.values():
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled
        for name, handler in self.signals.items():
            if signal.getsignal(getattr(signal, name)) is not handler and handler is not None:
                signal.signal(getattr(signal, name), handler)
        if hasattr(signal, "alarm"):
            signal.alarm(0)
        if "tqdm" in sys.modules:
            # tqdm's monitor thread (started by the first bar, lives for the process) is
            # stopped as a process exit would: the next bar starts a new one.
            bar_cls = sys.modules["tqdm"].tqdm
            if bar_cls.monitor is not None:
                bar_cls.monitor.exit()
                bar_cls.monitor = None
        deadline = time.monotonic() + 2.0
        for t in set(threading.enumerate()) - self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in set(threading.enumerate()) - self.threads)


def _end_accelerators() -> None:
    """End every Accelerator the call left alive, as mixprec's exit hook would ([Note:
    shutdown without end_training] in src/mixprec/accelerator.py), and stop their watchdogs."""
    import atexit as _atexit

    import mixprec.accelerator as acc_mod

    for acc in list(acc_mod._LIVE):
        wd = getattr(acc, "_watchdog", None)
        if not acc._ended:
            acc._ended = True
            if wd is not None:
                wd.stop()
            acc.engine.release()
        if wd is not None:
            _atexit.unregister(wd._at_exit)


def _teardown(saved: _Saved) -> bool:
    """Undo what the call left in this process ([Note: warm ranks]); True when clean."""
    import gc

    import torch.distributed as dist

    import mixprec.accelerator as acc_mod
    from mixprec.checkpoint import sync as checkpoint_sync
    from mixprec.compat import state as compat_state
    from mixprec.distributed import watchdog
    from mixprec.distributed.state import DistributedState, destroy_distributed

    clean = True
    try:
        _end_accelerators()
    except Exception:  # noqa: BLE001 - a worker that cannot tidy up is replaced
        traceback.print_exc()
        clean = False
    gc.collect()
    try:
        if dist.is_available() and dist.is_initialized():
            destroy_distributed(DistributedState(group=dist.group.WORLD))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        clean = False
    acc_mod._CREATED_GROUPS.clear()
    compat_state.forget_process_states()
    watchdog._INSTANCES[0] = 0
    checkpoint_sync._INSTANCES[0] = 0
    watchdog._ACTIVE[0] = None
    try:
        clean = saved.restore() and clean
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        clean = False
    return clean
