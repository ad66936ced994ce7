"""``mixprec launch``: start N processes per node on top of ``torch.distributed.run``.

Example::

    mixprec launch --nproc-per-node 4 train.py --lr 3e-4
    # two nodes (run one command on each; node 0's address and a port both can reach):
    mixprec launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py
    mixprec launch --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py

Processes are started and rendezvous'd by PyTorch's elastic agent (static rendezvous at
``--master-addr:--master-port``; on one node a free port is picked when ``--master-port``
is omitted). mixprec adds supervision on top of the agent:

* each rank runs under a small bootstrap that records its pid and, when the script raises,
  its traceback (also into torchelastic's ``TORCHELASTIC_ERROR_FILE``);
* the first rank to fail is determined (a rank that dies without a traceback, e.g.
  SIGKILL, is found by its pid) and its traceback is printed first, naming the rank; the
  tracebacks of ranks that failed as a consequence come after it, in the final summary;
* once any rank has failed, the agent sends SIGTERM to the others at once, and mixprec
  SIGKILLs whatever is still alive ``KILL_AFTER_S`` seconds later (the agent itself
  would wait up to 30 s), so every rank is gone within ``KILL_AFTER_S`` + 0.1 s;
* when the ranks' desync watchdogs agree on a verdict (a rank that stopped making the
  collective calls the others wait in, see [Note: desync detection] in
  src/mixprec/distributed/watchdog.py), the launcher blames the rank the verdict names,
  not the one that timed out waiting, and prints that rank's Python stack;
* each rank dumps the stacks of all its threads (``faulthandler``) into the launcher's
  record directory on SIGUSR1, which the launcher sends to every rank still alive at the
  first failure: the summary shows where the blamed ranks (or, without a verdict, the
  ranks that did not fail) were;
* the launcher exits 1 when any rank failed; stopped by a signal (SIGTERM, SIGINT) it
  blames no rank and exits 128 + the signal number;
* every rank dies with the launcher, whatever ends it (SIGKILL included), see
  ``[Note: ranks die with their launcher]``.

``--config-file`` is handed to the script as the ``MIXPREC_CONFIG_FILE`` environment variable;
``--backend`` and ``--mixed-precision`` as ``MIXPREC_BACKEND`` and ``MIXPREC_MIXED_PRECISION``.
The configuration they make (with any ``MIXPREC_*`` variable already set) is resolved once
in the launcher before any rank starts: a typo or a conflict is one error, and no rank runs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

LAUNCH_DIR_ENV = "MIXPREC_LAUNCH_DIR"
CONFIG_FILE_ENV = "MIXPREC_CONFIG_FILE"
LAUNCHER_PID_ENV = "MIXPREC_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
KILL_AFTER_S = 5.0  # SIGKILL survivors this long after the first failure
POLL_S = 0.05
JOIN_TIMEOUT_S = 600.0  # torchrun's static rendezvous default
JOIN_REPORT_S = 10.0  # "waiting for 1 of 2 nodes ..." this often while waiting
_FIRST = "first_failure.json"
_VERDICT = "desync.json"  # written by the ranks' watchdogs (mixprec/distributed/watchdog.py)
_STACK_SIGNAL = signal.SIGUSR1


# ----------------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``launch`` options to ``parser`` (used by ``mixprec launch``)."""
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N",
                        help="processes to start on this node (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M", help="number of nodes (default 1)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                        help="this node's rank, 0..nnodes-1 (default 0)")
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1", metavar="A",
                        help="address of node 0, reachable from every node (default 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None, metavar="P",
                        help="free port on node 0 (required with --nnodes > 1; picked on one node)")
    parser.add_argument("--config-file", default=None, metavar="F",
                        help=f"config file passed to the script as ${CONFIG_FILE_ENV} (checked before any rank starts)")
    parser.add_argument("--backend", default=None, metavar="B",
                        help="backend for every rank (auto, single, ddp, zero1, zero2, zero3, fsdp), handed to the "
                             "ranks as $MIXPREC_BACKEND")
    parser.add_argument("--mixed-precision", "--mixed_precision", default=None, metavar="P",
                        help="precision for every rank (no, bf16, fp16, ...), handed to the ranks as "
                             "$MIXPREC_MIXED_PRECISION")
    parser.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_S, metavar="S",
                        help=f"with --nnodes > 1: give up when the other nodes have not joined within S seconds "
                             f"(default {JOIN_TIMEOUT_S:g}); while waiting, the launcher says every "
                             f"{JOIN_REPORT_S:g} s how many nodes are missing")
    parser.add_argument("--kill-after", type=float, default=KILL_AFTER_S, metavar="S",
                        help=f"SIGKILL ranks still alive S seconds after the first failure (default {KILL_AFTER_S})")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _validate(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise SystemExit(f"mixprec launch: --nproc-per-node {args.nproc_per_node} must be >= 1")
    if args.nnodes < 1:
        raise SystemExit(f"mixprec launch: --nnodes {args.nnodes} must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"mixprec launch: --node-rank {args.node_rank} must be in 0..{args.nnodes - 1} for --nnodes {args.nnodes}")
    if args.nnodes > 1 and args.master_port is None:
        raise SystemExit(
            f"mixprec launch: --nnodes {args.nnodes} needs --master-port (and --master-addr, node 0's "
            f"address): every node must use the same port, so it cannot be picked automatically"
        )
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise SystemExit(f"mixprec launch: --master-port {args.master_port} must be in 1..65535")
    if not args.join_timeout >= 1:
        raise SystemExit(f"mixprec launch: --join-timeout {args.join_timeout:g} must be >= 1 second")
    if not 0 < args.kill_after <= 8:
        raise SystemExit(f"mixprec launch: --kill-after {args.kill_after} must be in (0, 8] seconds")
    if not Path(args.script).is_file():
        raise SystemExit(f"mixprec launch: script {args.script!r} does not exist; pass the path of a Python file")
    if args.config_file is not None and not Path(args.config_file).is_file():
        raise SystemExit(f"mixprec launch: --config-file {args.config_file!r} does not exist; pass an existing file")


# Launcher flags that are config keys: handed to every rank as the key's MIXPREC_* variable.
CONFIG_FLAGS = {"backend": "MIXPREC_BACKEND", "mixed_precision": "MIXPREC_MIXED_PRECISION"}


def _config_env(args: argparse.Namespace) -> dict[str, str]:
    """The MIXPREC_* variables this launch hands to its ranks, after checking the whole
    configuration (``--config-file``, the flags, the caller's ``MIXPREC_*`` variables) once,
    here, with the world size the ranks will see: a typo or a conflict is one error before
    any rank starts, not one per rank plus a summary and a thread dump."""
    env: dict[str, str] = {}
    for flag, name in CONFIG_FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        given = os.environ.get(name)
        if given is not None and given != value:
            raise SystemExit(f"mixprec launch: --{flag.replace('_', '-')} {value} conflicts with ${name}={given} "
                             f"in the environment; give the value once (unset {name}, or drop the flag)")
        env[name] = value
    if args.config_file is not None:
        env[CONFIG_FILE_ENV] = str(Path(args.config_file).resolve())
    from .config import ConfigError, resolve  # torch is imported by the agent anyway

    try:
        resolve(None, env={**os.environ, **env}, world_size=args.nnodes * args.nproc_per_node)
    except ConfigError as e:
        raise SystemExit(f"mixprec launch: error: the configuration the ranks would get is invalid; no rank "
                         f"was started:\n{e}") from None
    return env


# ----------------------------------------------------------------------------- shared files
def _proc_start_time(pid: int) -> Optional[str]:
    """Field 22 of /proc/<pid>/stat (start time), or None when the process is gone/a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _claim_first(d: Path, data: dict) -> bool:
    """Atomically record ``data`` as the job's first failure; False when one is recorded."""
    try:
        fd = os.open(d / _FIRST, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    return True


def _dead_peers(d: Path, exclude: int) -> list[dict]:
    """Ranks on this node whose process is gone without a clean exit or a recorded error."""
    dead = []
    for pid_file in sorted(d.glob("rank*.pid")):
        info = _read_json(pid_file)
        if not info or info["rank"] == exclude:
            continue
        rank = info["rank"]
        if (d / f"rank{rank}.ok").exists() or (d / f"rank{rank}.err").exists():
            continue
        if _proc_start_time(info["pid"]) != info["start"]:
            dead.append(info)
    return dead


def _no_traceback_record(info: dict) -> dict:
    return {
        "rank": info["rank"],
        "local_rank": info["local_rank"],
        "node_rank": info["node_rank"],
        "pid": info["pid"],
        "traceback": None,
        "reason": "exited without a Python traceback (killed by a signal, os._exit, or a crash in native code)",
    }


# ----------------------------------------------------------------------------- worker side
def _die_with_launcher() -> None:
    """[Note: ranks die with their launcher] A SIGKILLed launcher runs no cleanup, so
    without help its ranks are adopted by PID 1 and train on (holding the GPUs and the
    port). Each rank asks the kernel for SIGKILL when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere this is a no-op). The signal is tied to the
    thread that forked the rank: the elastic agent starts ranks from the launcher's main
    thread, which lives as long as the launcher. The launcher may already be dead before
    prctl runs, so the rank then checks that its parent is still the launcher (pid
    exported as ``MIXPREC_LAUNCHER_PID``) and SIGKILLs itself when the launcher is gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
                print(f"[mixprec launch] prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this "
                      "rank will not die with its launcher", file=sys.stderr, flush=True)
        except (OSError, AttributeError):
            pass
    from .utils import pid_alive  # here: the launcher process itself need not import torch

    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and launcher.isdigit() and os.getppid() != int(launcher) and not pid_alive(int(launcher)):
        os.kill(os.getpid(), signal.SIGKILL)


    return True


def _worker_main(argv: list[str]) -> None:
    """Run the user script in this rank (started by the elastic agent)."""
    _die_with_launcher()
    d = Path(os.environ[LAUNCH_DIR_ENV])
    rank = int(os.environ["RANK"])
    me = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "pid": os.getpid(),
        "start": _proc_start_time(os.getpid()),
    }
    _write_json(d / f"rank{rank}.pid", me)
    # SIGUSR1 from the launcher: the stacks of every thread, into rank<r>.stack. The file
    # stays open for the life of the process (faulthandler writes to its descriptor).
    import faulthandler

    faulthandler.register(_STACK_SIGNAL, file=open(d / f"rank{rank}.stack", "w"), all_threads=True)
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code in (None, 0):
            (d / f"rank{rank}.ok").touch()
        else:
            _worker_failed(d, me, f"SystemExit({e.code!r})\n", e)
        raise
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then re-raised
        _worker_failed(d, me, traceback.format_exc(), e)
        sys.exit(1)
    (d / f"rank{rank}.ok").touch()


def _job_store():
    """A client of the rendezvous store (the ranks' MASTER_ADDR:MASTER_PORT, which is the
    launchers' store under the static rendezvous), or None when it does not answer."""
    from .distributed import rendezvous

    try:
        return rendezvous.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s=3.0)
    except Exception:  # noqa: BLE001 - node 0's launcher may be gone already
        return None


def _worker_failed(d: Path, me: dict, tb: str, exc: BaseException) -> None:
    from .distributed import rendezvous

    record = {k: me[k] for k in ("rank", "local_rank", "node_rank", "pid")}
    record.update(traceback=tb, reason="raised", time=time.time(), type=type(exc).__name__, message=str(exc)[:2000])
    _write_json(d / f"rank{me['rank']}.err", record)
    try:  # torchelastic's own error file, read by the agent's failure report
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception:  # noqa: BLE001 - best effort
        pass
    if (d / _VERDICT).exists():  # a desync verdict names who is to blame, in the summary
        print(f"[mixprec launch] rank {me['rank']} stopped after a collective desync verdict; "
              f"the launcher's summary names the rank to blame", file=sys.stderr, flush=True)
        return
    # [Note: failures across nodes] in mixprec/distributed/rendezvous.py: a failure already
    # published (by a rank of any node) came first; this error is most likely its
    # consequence (e.g. a collective losing its peer). A peer of this node that died
    # silently (SIGKILL) a moment ago also failed before us: give both time to show. With
    # several dead peers (the agent SIGTERMs the rest after a failure) the launcher decides
    # which was first, from the agent's exit codes.
    store = _job_store()
    published: Optional[dict] = None
    dead: list[dict] = []
    for _ in range(6):
        try:
            published = rendezvous.read_failure(store) if store is not None else None
        except Exception:  # noqa: BLE001 - the store's host went away
            store = None
        if published is not None and published["rank"] != me["rank"]:
            _claim_first(d, published)  # this node's summary prints it as the cause
            break
        dead = _dead_peers(d, exclude=me["rank"])
        if dead:
            if len(dead) == 1:
                first = _no_traceback_record(dead[0])
                _claim_first(d, first)
                published = _publish(store, first)
            break
        time.sleep(POLL_S)
    if published is None and not dead:
        rec = rendezvous.failure_record(rank=me["rank"], local_rank=me["local_rank"], node_rank=me["node_rank"],
                                        pid=me["pid"], exc=exc, traceback_text=tb, reason="raised")
        published = _publish(store, rec) or rec
        if published["rank"] == me["rank"] and _claim_first(d, record):
            print(f"[mixprec launch] rank {me['rank']} failed first (node {me['node_rank']}, local rank "
                  f"{me['local_rank']}, pid {me['pid']}):\n{tb}", file=sys.stderr, end="", flush=True)
            return
    after = f"{rendezvous.describe(published)}" if published is not None else "another rank failed"
    print(f"[mixprec launch] rank {me['rank']} failed after another rank ({after}); the first failure's "
          f"traceback is in the launchers' summaries", file=sys.stderr, flush=True)


def _publish(store, record: dict) -> Optional[dict]:
    """Publish ``record`` as the job's first failure; the record that holds, or None
    without a store."""
    from .distributed import rendezvous

    if store is None:
        return None
    try:
        return rendezvous.publish_failure(store, record)
    except Exception:  # noqa: BLE001 - the store's host went away
        return None


# ----------------------------------------------------------------------------- launcher side
class _Supervisor(threading.Thread):
    """Watches this node's ranks; after the first failure, SIGKILLs survivors in time."""

    def __init__(self, d: Path, kill_after: float, store_at: Optional[tuple[str, int]] = None,
                 node_rank: int = 0) -> None:
        super().__init__(name="mixprec-supervisor", daemon=True)
        self.d = d
        self.kill_after = kill_after
        # With several nodes: the rendezvous store, where failures are published ([Note:
        # failures across nodes] in mixprec/distributed/rendezvous.py); None on one node.
        self.store_at = store_at
        self.node_rank = node_rank
        self.store = None
        self._next_connect = 0.0
        self.remote: Optional[dict] = None  # another node's failure, once seen
        self.failed_at: Optional[float] = None
        self.killed: list[int] = []
        self.silent: dict[int, tuple[float, dict]] = {}
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        while not self._halt.wait(POLL_S):
            if self.store_at is not None:
                self._poll_store()
            self.scan()
            if self.failed_at is not None and time.monotonic() - self.failed_at >= self.kill_after:
                self._kill_survivors()
        self.scan()

    def scan(self) -> None:
        """Note ranks that died silently (with the time first seen) and any recorded error."""
        for info in _dead_peers(self.d, exclude=-1):
            # Re-check: the rank may have written .ok/.err between the two reads.
            if not (self.d / f"rank{info['rank']}.ok").exists() and not (self.d / f"rank{info['rank']}.err").exists():
                if info["rank"] not in self.silent and self.store is not None and not (self.d / _VERDICT).exists():
                    _publish(self.store, _no_traceback_record(info))  # the other nodes learn of it
                self.silent.setdefault(info["rank"], (time.monotonic(), info))
                self._mark()
        if any(self.d.glob("rank*.err")):
            self._mark()

    def _poll_store(self) -> None:
        """Read the job's published first failure; one from another node stops this node's
        ranks and becomes this node's first failure ([Note: failures across nodes])."""
        from .distributed import rendezvous

        if self.failed_at is not None or (self.d / _FIRST).exists():
            # This node's first failure is known (and published): nothing more to read. Node
            # 0's launcher, which hosts the store, may be gone: a client would only retry.
            self.store_at, self.store = None, None
            return
        if self.store is None:
            # The store exists once the ranks do (the rendezvous made it before starting them).
            if time.monotonic() < self._next_connect or not any(self.d.glob("rank*.pid")):
                return
            try:
                self.store = rendezvous.connect(*self.store_at, timeout_s=2.0)
            except Exception:  # noqa: BLE001 - node 0's launcher is gone
                self._next_connect = time.monotonic() + 1.0
                return
        try:
            record = rendezvous.read_failure(self.store)
        except Exception:  # noqa: BLE001 - the store's host (node 0's launcher) went away: stop
            self.store_at, self.store = None, None
            return
        if record is None or self.remote is not None or record["node_rank"] == self.node_rank:
            return
        self.remote = record
        _claim_first(self.d, record)
        print(f"[mixprec launch] node {self.node_rank}: {rendezvous.describe(record)} first; stopping this "
              f"node's ranks (its traceback follows in the summary)", file=sys.stderr, flush=True)
        self._mark()  # stacks of this node's ranks (where they were), then SIGKILL after kill_after
        time.sleep(0.2)  # let faulthandler write them before SIGTERM
        for info in self._alive():
            try:
                os.kill(info["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _alive(self) -> list[dict]:
        out = []
        for pid_file in self.d.glob("rank*.pid"):
            info = _read_json(pid_file)
            if info and _proc_start_time(info["pid"]) == info["start"]:
                out.append(info)
        return out

    def claim_silent_first(self, exitcodes: dict[int, int]) -> None:
        """Without a claimed first failure, pick the silently dead rank that failed first:
        ranks ended by the shutdown itself (SIGTERM from the agent, SIGKILL from us) come
        last, then the earliest seen."""

        def key(rank: int):
            code = exitcodes.get(rank)
            consequence = code == -signal.SIGTERM or rank in self.killed
            return (consequence, self.silent[rank][0], rank)

        if self.silent:
            first = min(self.silent, key=key)
            record = _no_traceback_record(self.silent[first][1])
            if exitcodes.get(first) is not None:
                record["reason"] += f"; exit code {exitcodes[first]}"
            _claim_first(self.d, record)

    def _mark(self) -> None:
        if self.failed_at is None:
            self.failed_at = time.monotonic()
            self._dump_stacks()

    def _dump_stacks(self) -> None:
        """Ask every rank still alive for its threads' stacks (faulthandler, rank<r>.stack)."""
        for info in self._alive():
            try:
                os.kill(info["pid"], _STACK_SIGNAL)
            except ProcessLookupError:
                pass

    def _kill_survivors(self) -> None:
        for info in self._alive():
            try:
                os.kill(info["pid"], signal.SIGKILL)
                self.killed.append(info["rank"])
            except ProcessLookupError:
                pass


def _stack_of(d: Path, rank: int) -> str:
    try:
        return (d / f"rank{rank}.stack").read_text()
    except OSError:
        return ""


def _summary(d: Path, agent_error: Optional[BaseException]) -> None:
    first = _read_json(d / _FIRST)
    out = sys.stderr
    verdict = _read_json(d / _VERDICT)
    if verdict is not None:
        blamed = verdict["blamed"]
        print(f"[mixprec launch] FAILED: collective desync: rank(s) {blamed} stopped making the "
              f"collective calls the other ranks waited in (the ranks' watchdog verdict; the ranks "
              f"that timed out waiting are not to blame):\n{verdict['report']}", file=out)
        for r in blamed:
            stack = verdict.get("stacks", {}).get(str(r)) or _stack_of(d, r)
            if stack:
                print(f"[mixprec launch] rank {r}'s stack when it was blamed:\n{stack.rstrip()}", file=out)
        for err_file in sorted(d.glob("rank*.err")):
            rec = _read_json(err_file)
            if rec:
                last = (rec.get("traceback") or "").rstrip().splitlines()[-1:] or [rec.get("reason", "")]
                print(f"[mixprec launch] rank {rec['rank']} raised: {last[0][:200]}", file=out)
        out.flush()
        return
    if first is not None:
        where = f"node {first['node_rank']}, local rank {first['local_rank']}, pid {first['pid']}"
        if first.get("traceback"):
            print(f"[mixprec launch] FAILED: rank {first['rank']} failed first ({where}):\n"
                  f"{first['traceback']}", file=out, end="")
        else:
            print(f"[mixprec launch] FAILED: rank {first['rank']} failed first ({where}): {first['reason']}",
                  file=out)
    secondary = []
    for err_file in sorted(d.glob("rank*.err")):
        rec = _read_json(err_file)
        if rec and (first is None or rec["rank"] != first["rank"]):
            secondary.append(rec)
    for rec in secondary:
        print(f"[mixprec launch] rank {rec['rank']} also failed (node {rec['node_rank']}, local rank "
              f"{rec['local_rank']}):\n{rec['traceback']}", file=out, end="")
    # Where the ranks that did not fail were when the first failure was seen (SIGUSR1 dumps):
    # a rank stuck outside any collective shows up here.
    for stack_file in sorted(d.glob("rank*.stack")):
        rank = int(stack_file.stem[4:])
        text = _stack_of(d, rank)
        if text.strip() and (first is None or rank != first["rank"]):
            print(f"[mixprec launch] rank {rank}'s threads when the first failure was seen:\n{text.rstrip()}",
                  file=out)
    if first is None and agent_error is not None:
        print(f"[mixprec launch] FAILED: {agent_error}", file=out)
    out.flush()


def run_launch(args: argparse.Namespace) -> int:
    """Start the job described by parsed ``launch`` arguments; return the exit code."""
    _validate(args)
    config_env = _config_env(args)
    saved = {k: os.environ.get(k) for k in (LAUNCH_DIR_ENV, LAUNCHER_PID_ENV, *config_env)}
    try:
        os.environ.update(config_env)
        return _run(args)
    finally:  # the agent passes os.environ to the ranks; leave the caller's as it was
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from .distributed.rendezvous import register_launch_rendezvous

    # 0: node 0's store takes a free port in the bind itself ([Note: the launcher's store]
    # in src/mixprec/distributed/rendezvous.py); only a multi-node run needs it fixed.
    port = args.master_port if args.master_port is not None else 0
    with tempfile.TemporaryDirectory(prefix="mixprec-launch-") as tmp:
        d = Path(tmp)
        os.environ[LAUNCH_DIR_ENV] = str(d)
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        torchrun_argv = [
            f"--nproc-per-node={args.nproc_per_node}",
            f"--nnodes={args.nnodes}",
            f"--node-rank={args.node_rank}",
            f"--master-addr={args.master_addr}",
            f"--master-port={port}",
            "--rdzv-backend=static",
            f"--rdzv-conf=timeout={int(args.join_timeout)}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            "-m",
            "mixprec.launch",
            args.script,
            *args.script_args,
        ]
        config, cmd, cmd_args = config_from_args(parse_args(torchrun_argv))
        config.rdzv_backend = register_launch_rendezvous()  # torch's static one, bound where asked
        if hasattr(config, "shutdown_timeout"):
            config.shutdown_timeout = max(1, int(args.kill_after))
        several = args.nnodes > 1
        supervisor = _Supervisor(d, args.kill_after, (args.master_addr, port) if several else None, args.node_rank)
        supervisor.start()
        join_watch = None
        if several:  # [Note: a launcher that speaks while it waits] in mixprec/distributed/rendezvous.py
            from .distributed.rendezvous import JoinWatch

            join_watch = JoinWatch(args.master_addr, port, args.node_rank, args.nnodes, args.join_timeout,
                                   started=lambda: any(d.glob("rank*.pid")), interval_s=JOIN_REPORT_S)
            join_watch.start()
        agent_error: Optional[BaseException] = None
        stopped_by: Optional[int] = None
        try:
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        except ChildFailedError as e:
            agent_error = e
        except SignalException as e:  # the launcher itself got SIGTERM/SIGINT/...
            agent_error = e
            stopped_by = int(e.sigval)
        except Exception as e:  # noqa: BLE001 - rendezvous errors etc. are reported, not re-raised
            agent_error = e
        finally:
            supervisor.stop()
            if join_watch is not None:
                join_watch.stop()
        if several and agent_error is not None and not any(d.glob("rank*.pid")) and stopped_by is None:
            # The rendezvous never completed: no rank of this node started.
            print(f"[mixprec launch] FAILED: node {args.node_rank}: the {args.nnodes} nodes did not all join at "
                  f"{args.master_addr}:{port} within --join-timeout {args.join_timeout:g} s ({_first_line(agent_error)}). "
                  f"Fix: start `mixprec launch` on every node with the same --nnodes {args.nnodes}, "
                  f"--master-addr and --master-port, each with its own --node-rank 0..{args.nnodes - 1}; check that "
                  f"node 0's address and port are reachable from this node; or raise --join-timeout",
                  file=sys.stderr, flush=True)
            return 1
        exitcodes = {}
        if isinstance(agent_error, ChildFailedError):
            exitcodes = {rank: f.exitcode for rank, f in agent_error.failures.items()}
        if stopped_by is not None and not (d / _FIRST).exists() and not (d / _VERDICT).exists() \
                and not any(d.glob("rank*.err")):
            # The ranks died of the signal the agent forwarded: none of them is to blame.
            print(f"[mixprec launch] stopped by {signal.Signals(stopped_by).name} sent to the launcher; "
                  f"every rank was terminated (no rank failed on its own)", file=sys.stderr, flush=True)
            return 128 + stopped_by
        if not (d / _FIRST).exists() and not (d / _VERDICT).exists():
            supervisor.claim_silent_first(exitcodes)
        failed = agent_error is not None or (d / _FIRST).exists() or (d / _VERDICT).exists()
        if failed:
            _summary(d, agent_error if not isinstance(agent_error, ChildFailedError) else None)
            if not (d / _FIRST).exists() and not (d / _VERDICT).exists() and isinstance(agent_error, ChildFailedError):
                print(f"[mixprec launch] FAILED:\n{agent_error.format_msg()}", file=sys.stderr)
            return 1
        return 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m mixprec.launch`` / ``mixprec launch`` entry point."""
    parser = add_arguments(argparse.ArgumentParser(prog="mixprec launch", description=__doc__.split("\n")[0]))
    return run_launch(parser.parse_args(argv))


if __name__ == "__main__":
    if os.environ.get(LAUNCH_DIR_ENV) and "RANK" in os.environ:
        _worker_main(sys.argv[1:])
    else:
        sys.exit(main())
