"""Collective desync detection: a rank that makes a collective call the others do not make
stops the run with an error naming the call, its source line and the rank to blame,
instead of hanging until the process group's 30-minute timeout.

[Note: desync detection]
Two mechanisms, both off the data path of the collectives themselves:

* Every user-level collective (``gather``, ``reduce``, ``broadcast``, ``wait_for_everyone``,
  ``get_state_dict``, ``optimizer.step``, ``backward``, ``clip_grad_norm_``, ...) is *tracked*:
  the calling thread records, locally, the call's name, a per-call sequence number and the
  caller's frame (the user's source line is found from it only when a report is written).
  That costs about a microsecond and no communication (benchmarks/bench_desync_check.py).
  A daemon thread per rank (the *watchdog*) polls every ``POLL_S``; when its rank has been
  inside one tracked call longer than the timeout it asks every rank's watchdog, through the
  process group's TCP key-value store (which needs no collective, so the question itself
  cannot hang), what its main thread is doing: the call it is in (name, number, source
  line, tensor shapes), or "not in any collective" with the Python stack of its main thread,
  and how far its prepared dataloader got. From the answers it writes one verdict (who did
  not arrive, who arrived at another call) into the store; every rank prints it and ends with
  ``os._exit(EXIT_CODE)`` (the waiting ranks' main threads are blocked inside the backend
  and cannot raise). Under ``mixprec launch`` the verdict also names the rank to blame in
  the launcher's record directory (``desync.json``), so the launcher blames the rank that
  stopped progressing, not the one that timed out waiting.

* The calls whose tensors must agree across ranks, or which are rare (``gather``,
  ``gather_for_metrics``, ``reduce``, ``broadcast``, ``broadcast_object_list``,
  ``pad_across_processes``, ``wait_for_everyone``, ``main_process_first``,
  ``get_state_dict``), are also *checked* before any backend collective: each rank puts its
  call, source line and tensor shapes/dtypes into the store and reads the others' (two
  store round trips). A different call or a shape mismatch raises
  :class:`CollectiveDesyncError` on every rank at once, naming every rank's call, line and
  shapes; Gloo would instead abort the process natively ("Received data size doesn't
  match") or pair the call with an unrelated collective. A rank that does not arrive within
  the timeout is diagnosed as above, and the waiting rank raises (its main thread is free),
  whichever rank wrote the verdict: its watchdog thread leaves the raise to it.
  ``main_process_first`` waits without deadline while the main process is inside the
  block (a long download is legitimate): a check that times out asks first, and waits on
  when every missing rank reports being in a ``main_process_first`` block.

A backend error inside a tracked call (Gloo's "Connection closed by peer" when a rank
exited, or its own timeout) is diagnosed the same way before it is re-raised, so uneven
data ("rank 1's dataloader ran out after 3 batches") is named instead of a socket error.

Under ``mixprec launch`` a rank that raised publishes its exception in the same store
([Note: failures across nodes] in src/mixprec/distributed/rendezvous.py). A published
failure of another rank comes first: no verdict is written and no collective is blamed; the
main thread raises :class:`~mixprec.errors.PeerFailedError` quoting that failure (from a
check or a backend error), and the watchdog thread, which reads the key at every poll,
ends a rank blocked in the backend with exit code ``PEER_FAILED_EXIT_CODE`` (88).

Configuration: ``collective_timeout`` (seconds, default 30; null: all of this off), see
docs/configuration.md. Exit code of a rank stopped by a verdict: ``EXIT_CODE`` (87).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveDesyncError, MixprecError, PeerFailedError
from . import rendezvous

EXIT_CODE = 87  # a rank stopped by a desync verdict exits with this code
PEER_FAILED_EXIT_CODE = 88  # a rank stopped because another rank's failure was published
POLL_S = 0.25  # how often each watchdog thread looks at its rank and at the store
DEFAULT_TIMEOUT_S = 30.0
VERDICT_FILE = "desync.json"  # in $MIXPREC_LAUNCH_DIR: the rank the launcher blames

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
_INSTANCES = [0]  # watchdogs created in this process (same count on every rank)
_ACTIVE: list = [None]  # the watchdog tracked calls report to (the newest running one)


# ----------------------------------------------------------------------------- helpers
def _user_frame(frame):
    """The first frame outside the mixprec package (and contextlib), walking outwards."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_PKG_DIR) or name == _CONTEXTLIB):
            return frame
        frame = frame.f_back
    return None


def _where(frame) -> str:
    frame = _user_frame(frame)
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _shapes(tree: Any) -> list[str]:
    """``["(4, 3) float32", ...]`` for every tensor in ``tree``, in order."""
    out: list[str] = []

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out.append(f"{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')}")
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x)
        elif isinstance(obj, dict):
            for k in obj:
                visit(obj[k])

    visit(tree)
    return out


def _is_backend_error(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, RuntimeError) and not isinstance(e, MixprecError) and (
        "gloo" in text.lower() or "Connection closed by peer" in text or "Connection reset" in text
        or isinstance(e, getattr(dist, "DistBackendError", ()))
    )


def _main_stack() -> str:
    """The main thread's stack, without mixprec's and runpy's frames (the launcher's
    bootstrap) unless nothing else is left."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "  <no main thread>\n"
    frames = traceback.extract_stack(frame)
    mine = [f for f in frames if not (f.filename.startswith(_PKG_DIR) or f.filename.startswith("<frozen"))]
    return "".join(traceback.format_list(mine or frames))


def _tcp_address(store) -> Optional[tuple[str, int]]:
    while store is not None:
        if isinstance(store, dist.TCPStore):
            return store.host, store.port
        store = getattr(store, "underlying_store", None)
    return None


class _StoreGone(Exception):
    pass


# ----------------------------------------------------------------------------- the watchdog
class Watchdog:
    """Desync detection for one rank of one Accelerator ([Note: desync detection]).

    Example::

        wd = Watchdog.create(state, timeout_s=30)   # None on one process / when off; else
                                                    # tracked calls report to it:
        @tracked("gather", tree_signature)          # checked: shapes compared first
        def gather(state, tree): ...
    """

    def __init__(self, rank: int, world_size: int, address: tuple[str, int], timeout_s: float,
                 prefix: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.address = address
        self.timeout_s = float(timeout_s)
        self.prefix = prefix
        # Main-thread record, written by tracked calls (plain attribute stores: cheap).
        self.seq = 0  # tracked calls entered so far
        self.call: Optional[str] = None  # the tracked call the main thread is in
        self.frame = None  # the caller's frame of that call (its source line, lazily)
        self.since = 0.0  # time.monotonic() when it was entered (or its body started)
        self.checking = False  # inside the store check (the main thread handles its timeout)
        self.shapes: Optional[list[str]] = None
        self.last: Optional[str] = None  # "name #seq" of the last call that returned
        self.long_body = False  # inside main_process_first's block on the main process
        self.batches = 0  # batches the current dataloader pass has given
        self.exhausted = False  # the last dataloader pass ran to its end
        self.checks = 0  # checked calls so far (the store check's own numbering)
        self._main_store = None  # store client of the main thread (the checks)
        self._thread_store = None  # store client of the watchdog thread
        self._garbage: list[str] = []  # store keys the watchdog thread deletes
        self._answered = 0  # status questions answered (the "query" counter in the store)
        self.raised = False  # the main thread raised a verdict (the thread then stops watching)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- construction ------------------------------------------------------------------
    @classmethod
    def create(cls, state, timeout_s: Optional[float]) -> Optional["Watchdog"]:
        """The watchdog for ``state``'s group, started; None on one process or when
        ``timeout_s`` is None (off) or the group's store is not a TCP store."""
        if timeout_s is None or state.world_size <= 1 or state.group is None:
            return None
        if not timeout_s > 0:
            raise ValueError(f"collective_timeout={timeout_s!r} must be > 0 seconds, or null to turn desync detection off")
        address = _tcp_address(dist.distributed_c10d._get_default_store())
        if address is None:
            return None
        _INSTANCES[0] += 1
        prefix = f"mixprec/desync/{state.group.group_name}/{_INSTANCES[0]}/"
        wd = cls(state.rank, state.world_size, address, timeout_s, prefix)
        wd.start()
        return wd

    def _client(self, timeout_s: float):
        host, port = self.address
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    def start(self) -> None:
        # Both connections are opened now, while the store's host is surely alive.
        self._main_store = self._client(self.timeout_s)
        self._thread_store = self._client(max(10.0, self.timeout_s))
        self._thread = threading.Thread(target=self._run, name="mixprec-desync-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)
        _ACTIVE[0] = self

    def stop(self) -> None:
        """Stop the thread (end of training); later tracked calls are not watched."""
        self._publish_exit("ended training")
        self._stop.set()
        if _ACTIVE[0] is self:
            _ACTIVE[0] = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S + 1)

    def abandon(self) -> None:
        """Its Accelerator was garbage-collected without end_training(): the thread stops at
        its next poll. Nothing is joined or published (this runs as a finalizer, wherever the
        collection happens); a later Accelerator has its own watchdog under its own prefix."""
        self._stop.set()
        if _ACTIVE[0] is self:
            _ACTIVE[0] = None
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        if not self._stop.is_set():
            self._publish_exit("exited")
            self._stop.set()

    def _publish_exit(self, how: str) -> None:
        if self._stop.is_set():
            return
        # Only over a connection already open: connecting to a store whose host has exited
        # (rank 0 under plain env:// start-up) would retry for seconds at every exit.
        store = self._main_store or self._thread_store
        if store is None:
            return
        try:
            store.set(self.prefix + f"exited/{self.rank}", json.dumps({"how": how, **self._loader()}))
        except Exception:  # noqa: BLE001 - the store host may be gone already
            pass

    # -- main thread: tracking ---------------------------------------------------------
    def enter(self, name: str, frame) -> None:
        self.seq += 1
        self.call = name
        self.frame = frame
        self.shapes = None
        self.since = time.monotonic()

    def leave(self) -> None:
        self.last = f"{self.call} #{self.seq}"
        self.checking = False
        self.call = None
        self.frame = None
        self.shapes = None

    def loader_start(self) -> None:
        self.batches = 0
        self.exhausted = False

    def loader_end(self) -> None:
        """The dataloader pass ran out: recorded in the store (once per pass) so that a
        peer can name it even after this rank has exited."""
        self.exhausted = True
        if self._stop.is_set():
            return
        try:
            self._store_main().set(self.prefix + f"loader/{self.rank}", json.dumps(self._loader()))
        except Exception:  # noqa: BLE001 - diagnosis only; training goes on
            pass

    def _loader(self) -> dict:
        return {"batches": self.batches, "exhausted": self.exhausted}

    def _store_main(self):
        if self._main_store is None:
            self._main_store = self._client(self.timeout_s)
        return self._main_store

    def check(self, name: str, signature: str) -> None:
        """The store check of a checked call: every rank publishes ``name``, its source line
        and ``signature`` (shapes), then reads the others'; raises CollectiveDesyncError on a
        difference, diagnoses a rank that does not arrive in time."""
        self.checks += 1
        self.shapes = [signature] if signature else None
        store = self._store_main()
        mine = json.dumps({"call": name, "where": _where(self.frame), "sig": signature, "seq": self.seq})
        base = self.prefix + f"check/{self.checks}/"
        keys = [base + str(r) for r in range(self.world_size)]
        self.checking = True
        try:
            store.set(keys[self.rank], mine)
            if self.checks > 2:
                # Every rank has read round checks-2 (each wrote round checks-1 after reading
                # it); the watchdog thread deletes the key, off this thread's path.
                self._garbage.append(self.prefix + f"check/{self.checks - 2}/{self.rank}")
            while True:
                try:
                    values = store.multi_get(keys)
                    break
                except Exception as e:  # noqa: BLE001 - the store's timeout has its own type
                    if "timeout" not in str(e).lower() and "Timeout" not in type(e).__name__:
                        raise
                    verdict = self.diagnose(store, waiting_check=True)
                    if verdict is not None:
                        self.raised = True
                        self._settle(verdict, store)
                        raise CollectiveDesyncError(verdict["report"]) from None
                    # every missing rank is inside main_process_first's block: wait on
        finally:
            self.checking = False
            self.since = time.monotonic()  # the body's deadline starts now
        seen = {r: json.loads(v) for r, v in enumerate(values)}
        if all(s["call"] == name and s["sig"] == signature for s in seen.values()):
            return
        lines = [f"  rank {r}: {s['call']}() at {s['where']}" + (f", tensors {s['sig']}" if s["sig"] else "")
                 for r, s in seen.items()]
        if len({s["call"] for s in seen.values()}) > 1:
            head = (f"ranks made different collective calls at the same point (checked call "
                    f"{self.checks}):")
            fix = ("every rank must make the same collective calls in the same order; look for a "
                   "call under `if accelerator.is_main_process:` or a rank-dependent branch")
        else:
            head = f"{name}() got tensors of different shapes/dtypes on different ranks:"
            fix = (f"every rank must pass the same shapes and dtypes to {name}(); use "
                   "accelerator.pad_across_processes() first when dim 0 differs")
        raise CollectiveDesyncError("\n".join([head, *lines, fix]))

    # -- diagnosis (either thread) -----------------------------------------------------
    def status(self) -> dict:
        call, frame = self.call, self.frame
        out = {"rank": self.rank, "pid": os.getpid(), "call": call, "seq": self.seq,
               "last": self.last, "long_body": self.long_body, **self._loader()}
        if call is not None:
            out.update(where=_where(frame), waiting_s=round(time.monotonic() - self.since, 1),
                       shapes=self.shapes, checking=self.checking)
        else:
            out["stack"] = _main_stack()
        return out

    def _peer_failure(self, store) -> Optional[dict]:
        """Another rank's published failure, or None."""
        record = rendezvous.read_failure(store)
        return record if record is not None and record["rank"] != self.rank else None

    def _peer_failed_text(self, record: dict) -> str:
        where = f"{self.call}() at {_where(self.frame)}" if self.call is not None else "its training loop"
        tb = (record.get("traceback") or "").rstrip()
        return (f"{rendezvous.describe(record)} first (published through the rendezvous store); rank "
                f"{self.rank} stopped in {where} as a consequence: this is not a collective desync, fix "
                f"rank {record['rank']}'s error" + (f":\n{tb}" if tb else ""))

    def diagnose(self, store, waiting_check: bool = False, error: Optional[str] = None) -> Optional[dict]:
        """Ask every rank for its status through the store and publish a verdict; returns it
        (None when the wait is legitimate: every missing rank is in main_process_first).
        Raises :class:`PeerFailedError` instead when another rank's failure is published."""
        failure = self._peer_failure(store)
        if failure is not None:
            self.raised = True  # the thread stops watching: the raise is the report
            raise PeerFailedError(self._peer_failed_text(failure))
        existing = self._read_verdict(store)
        if existing is not None:
            return existing
        q = store.add(self.prefix + "query", 1)
        store.set(self.prefix + f"status/{q}/{self.rank}", json.dumps(self.status()))
        deadline = time.monotonic() + 4 * POLL_S + 2.0
        statuses: dict[int, Optional[dict]] = {}
        exited: dict[int, dict] = {}
        while time.monotonic() < deadline:
            # Two ranks may diagnose at once: each answers the other's question, and the
            # first verdict published is everyone's.
            existing = self._read_verdict(store)
            if existing is not None:
                return existing
            self._answer(store)
            for r in range(self.world_size):
                if r in statuses:
                    continue
                key = self.prefix + f"status/{q}/{r}"
                if store.check([key]):
                    statuses[r] = json.loads(store.get(key))
                elif store.check([self.prefix + f"exited/{r}"]):
                    exited[r] = json.loads(store.get(self.prefix + f"exited/{r}"))
                    statuses[r] = None
            if len(statuses) == self.world_size:
                break
            time.sleep(0.05)
        loaders = {}
        for r in range(self.world_size):
            key = self.prefix + f"loader/{r}"
            if statuses.get(r) is None and store.check([key]):
                loaders[r] = json.loads(store.get(key))
        mine = statuses[self.rank]
        others = [s for r, s in statuses.items() if r != self.rank]
        if waiting_check and any(s is not None and s["long_body"] for s in others) and all(
                s is not None and (s["long_body"] or s["call"] == mine["call"]) for s in others):
            return None  # the main process is inside main_process_first's block: wait on
        report, blamed = _verdict(self.rank, mine, statuses, exited, loaders, self.world_size,
                                  self.timeout_s, error)
        same_call = len({(st["call"], st["seq"]) for st in statuses.values() if st is not None}) == 1
        if error is None and not blamed and same_call:
            # Every rank is inside the same call: a slow step, not a desync (or a hang inside
            # the backend, which the process group's own timeout ends). Say so and go on.
            sys.stderr.write(f"[mixprec rank {self.rank}] every rank has been inside {mine['call']}() "
                             f"#{mine['seq']} for more than {self.timeout_s:g} s (collective_timeout): no "
                             f"rank is missing, so this is not a desync; waiting on\n")
            sys.stderr.flush()
            return None
        verdict = {"origin": self.rank, "report": report, "blamed": blamed,
                   "alive": [r for r, st in statuses.items() if st is not None],
                   "stacks": {str(r): statuses[r]["stack"] for r in blamed
                              if statuses.get(r) and statuses[r].get("stack")}}
        raw = json.dumps(verdict)
        current = store.compare_set(self.prefix + "verdict", "", raw)
        if current.decode() != raw:  # another rank's verdict came first: that one holds
            verdict = json.loads(current)
        _record_for_launcher(verdict)
        return verdict

    def _answer(self, store) -> None:
        """Publish this rank's status for every question asked since the last answer."""
        q = int(store.add(self.prefix + "query", 0))
        if q > self._answered:
            status = json.dumps(self.status())
            for k in range(self._answered + 1, q + 1):
                store.set(self.prefix + f"status/{k}/{self.rank}", status)
            self._answered = q

    def _read_verdict(self, store) -> Optional[dict]:
        if store.check([self.prefix + "verdict"]):
            return json.loads(store.get(self.prefix + "verdict"))
        return None

    def _settle(self, verdict: dict, store) -> None:
        """Before this rank stops on ``verdict``: its origin gives the others a moment to
        read it; every other rank acknowledges it, so that the origin need not wait."""
        try:
            if verdict["origin"] == self.rank:
                self.stop_peers_then(store)
            else:
                store.add(self.prefix + "acks", 1)
        except Exception:  # noqa: BLE001 - the store's host may be gone
            pass

    def stop_peers_then(self, store) -> None:
        """Give the other ranks' watchdogs a moment to read the verdict (the store may
        live in this process)."""
        deadline = time.monotonic() + 4 * POLL_S + 1.0
        try:
            verdict = self._read_verdict(store) or {}
        except Exception:  # noqa: BLE001 - the store's host is gone
            return
        others = len([r for r in verdict.get("alive", range(self.world_size)) if r != self.rank])
        while time.monotonic() < deadline:
            try:
                if int(store.add(self.prefix + "acks", 0)) >= others:
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.05)

    def backend_error(self, e: BaseException) -> None:
        """A backend error inside a tracked call: diagnose, then raise the verdict from it."""
        self.checking = True  # this thread reports it: the watchdog thread must not fire
        try:
            store = self._store_main()
            verdict = self.diagnose(store, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            if verdict is not None:
                self.raised = True
                self._settle(verdict, store)
        except CollectiveDesyncError:
            raise
        except PeerFailedError as peer:
            raise peer from e
        except Exception:  # noqa: BLE001 - no store: the original error stands
            return
        if verdict is not None:
            raise CollectiveDesyncError(verdict["report"]) from e

    # -- the watchdog thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            store = self._thread_store = self._thread_store or self._client(max(10.0, self.timeout_s))
        except Exception:  # noqa: BLE001 - no store: nothing to watch with
            return
        diagnosed = (-1, 0.0)  # the tracked call last diagnosed (its number), when to look again
        grace_until = None  # a peer's verdict while the main thread is in a store check
        while not self._stop.wait(POLL_S):
            try:
                if self.raised:
                    return  # the main thread raised the verdict: the user's code handles it
                failure = self._peer_failure(store)
                if failure is not None:
                    # As with a peer's verdict below: a main thread in a store check raises
                    # PeerFailedError itself within the timeout; otherwise it may be blocked
                    # in the backend, waiting for the rank that failed, and cannot raise.
                    if self.checking and grace_until is None:
                        grace_until = time.monotonic() + self.timeout_s + 4 * POLL_S + 2.0
                    if self.raised:
                        return
                    if not self.checking or time.monotonic() > grace_until:
                        self._stop_for_peer(failure)
                    continue
                verdict = self._read_verdict(store)
                if verdict is not None and verdict["origin"] != self.rank:
                    # The main thread raises the verdict itself from a store check (or from
                    # a backend error it is diagnosing): its store wait ends within the
                    # timeout. Ending the process here would race that raise, so the thread
                    # waits, and ends the process only if the main thread never gets there.
                    # `checking` is read before `raised`: the main thread sets `raised` before
                    # it leaves the check, so a check seen as left was either raised from or
                    # not a store check at all.
                    checking = self.checking
                    if checking and grace_until is None:
                        grace_until = time.monotonic() + self.timeout_s + 4 * POLL_S + 2.0
                    if self.raised:
                        return
                    if not checking or time.monotonic() > grace_until:
                        self._die(verdict, store)
                    continue
                self._answer(store)
                while self._garbage:
                    store.delete_key(self._garbage.pop())
                now = time.monotonic()
                due = self.since + self.timeout_s if self.seq != diagnosed[0] else diagnosed[1]
                if self.call is not None and not self.checking and not self.long_body and now > due:
                    diagnosed = (self.seq, now + self.timeout_s)  # again a timeout later
                    try:
                        verdict = self.diagnose(store)
                    except PeerFailedError:
                        self._stop_for_peer(self._peer_failure(store))
                    if verdict is not None:
                        self._die(verdict, store)
            except Exception:  # noqa: BLE001 - the store is gone (its host exited): stop watching
                return

    def _die(self, verdict: dict, store) -> None:
        """Print the verdict and end this process (its main thread may be blocked inside
        the backend, where it cannot be interrupted)."""
        sys.stderr.write(f"[mixprec rank {self.rank}] collective desync, stopping this rank "
                         f"(exit code {EXIT_CODE}):\n{verdict['report']}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        self._settle(verdict, store)
        os._exit(EXIT_CODE)

    def _stop_for_peer(self, record: dict) -> None:
        """Another rank's failure was published: end this rank (its main thread may be
        blocked inside the backend, waiting for the rank that failed), quoting it."""
        sys.stderr.write(f"[mixprec rank {self.rank}] stopping (exit code {PEER_FAILED_EXIT_CODE}): "
                         f"{rendezvous.describe(record)} first; its traceback is in the launchers' summaries\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(PEER_FAILED_EXIT_CODE)

    # -- wrapping ----------------------------------------------------------------------
    def run(self, name: str, frame, fn: Callable, args: tuple, kwargs: dict,
            signature: Optional[Callable[..., str]] = None):
        """Run ``fn(*args, **kwargs)`` as the tracked call ``name``; checked first when
        ``signature`` is given (it maps the call's arguments to the string compared)."""
        self.enter(name, frame)
        try:
            if signature is not None:
                self.check(name, signature(*args[1:], **kwargs))
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if _is_backend_error(e):
                self.backend_error(e)
            raise
        finally:
            self.leave()


def _loader_text(info: dict, sep: str = "; ") -> str:
    if info["exhausted"]:
        return f"{sep}its dataloader ran out after {info['batches']} batches"
    if info["batches"]:
        return f"{sep}its dataloader is at batch {info['batches']}"
    return ""


def _verdict(me: int, mine: dict, statuses: dict, exited: dict, loaders: dict, world: int,
             timeout_s: float, error: Optional[str]) -> tuple[str, list[int]]:
    """The report every rank prints, and the ranks blamed."""
    call = mine["call"] or "?"
    what = f"{call}() at {mine.get('where', '<unknown>')} (call #{mine['seq']})"
    if error is not None:
        head = f"rank {me} failed in {what}: {error}"
    else:
        head = f"rank {me} waited {mine.get('waiting_s', timeout_s)} s (collective_timeout {timeout_s:g} s) in {what}"
    lines = [f"collective desync: {head}", "ranks:"]
    blamed: list[int] = []
    groups: dict[tuple, list[int]] = {}
    for r in range(world):
        s = statuses.get(r)
        if s is None:
            if r in exited:
                lines.append(f"  rank {r}: {exited[r]['how']}{_loader_text(exited[r])}")
            else:
                lines.append(f"  rank {r}: did not answer (dead, or stuck in native code holding the GIL)"
                             + (_loader_text(loaders[r]) if r in loaders else ""))
            blamed.append(r)
        elif s["call"] is None:
            lines.append(f"  rank {r}: not in any collective (last: {s['last'] or 'none'}"
                         f"{_loader_text(s)}); its main thread is at:")
            lines.extend("    " + line for line in s["stack"].rstrip("\n").splitlines())
            blamed.append(r)
        else:
            shapes = f", tensors {', '.join(s['shapes'])}" if s.get("shapes") else ""
            lines.append(f"  rank {r}: in {s['call']}() at {s['where']} (call #{s['seq']}{shapes}, "
                         f"for {s['waiting_s']} s{_loader_text(s)})")
            groups.setdefault((s["call"], s["seq"]), []).append(r)
    if len(groups) > 1 and not blamed:
        # Different calls at the same point: the ranks outside the largest group are blamed
        # (on a tie, those outside the group of the lowest rank).
        biggest = max(groups.values(), key=lambda g: (len(g), -min(g)))
        biggest_call = next(k[0] for k, g in groups.items() if g is biggest)
        blamed = sorted(r for g in groups.values() if g is not biggest for r in g)
        lines.append("ranks are in different collective calls: every rank must make the same "
                     "collective calls in the same order")
    counts = {r: (statuses.get(r) or exited.get(r) or loaders.get(r)) for r in range(world)}
    finished = [r for r, info in counts.items() if info and info.get("exhausted")]
    if finished and len({info["batches"] for info in counts.values() if info}) > 1:
        lines.append(
            "uneven data: " + ", ".join(f"rank {r}'s dataloader ran out after {counts[r]['batches']} batches"
                                        for r in finished)
            + " while other ranks were still iterating; keep even_batches=True (the default) for "
            "prepared dataloaders, or give every rank the same number of batches (drop_last=True)")
    if blamed:
        lines.append(f"blamed: rank(s) {blamed} (did not reach the collective the others wait in)"
                     if len(groups) <= 1 else f"blamed: rank(s) {blamed} (in another call than rank "
                     f"{min(biggest)}'s {biggest_call}())")
    else:
        lines.append("every rank is inside the same collective: the hang is inside the backend "
                     "(network, or a peer process stopped)")
    lines.append("fix: every rank must make the same collective calls in the same order; "
                 "collective_timeout (docs/configuration.md) sets how long a rank waits "
                 "(null turns this check off)")
    return "\n".join(lines), blamed


def _record_for_launcher(verdict: dict) -> None:
    """Under ``mixprec launch``: the first verdict names the rank to blame
    (``$MIXPREC_LAUNCH_DIR/desync.json``, created exclusively)."""
    d = os.environ.get("MIXPREC_LAUNCH_DIR")
    if not d:
        return
    try:
        fd = os.open(os.path.join(d, VERDICT_FILE), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        json.dump(verdict, f)


# ----------------------------------------------------------------------------- decorators
def tracked(name: str, signature: Optional[Callable[..., str]] = None):
    """Decorator of a collective (a function taking the state first, or a method): run it as
    the tracked call ``name`` of the running watchdog, checked first when ``signature`` is
    given (it receives the arguments after the first). A call inside another tracked call is
    not tracked again; without a running watchdog (one process, or off) it is a plain call."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            wd = _ACTIVE[0]
            if wd is None or wd.call is not None:
                return fn(*args, **kwargs)
            return wd.run(name, sys._getframe(1), fn, args, kwargs, signature)

        return wrapper

    return deco


def tree_signature(tree: Any, *_, **__) -> str:
    """Shapes and dtypes of every tensor: what gather/reduce/broadcast need equal."""
    return ", ".join(_shapes(tree)) or type(tree).__name__


def pad_signature(tree: Any, dim: int = 0, *_, **__) -> str:
    """pad_across_processes: the sizes along ``dim`` may differ, the rest may not."""
    out = []
    for s in _shapes(tree):
        shape, dtype = s.rsplit(" ", 1)
        dims = [x for x in shape.strip("()").split(",") if x.strip()]
        if dims and -len(dims) <= dim < len(dims):
            dims[dim] = "*"
        out.append(f"({', '.join(d.strip() for d in dims)}) {dtype}")
    return ", ".join(out) or type(tree).__name__


def plain_signature(*_, **__) -> str:
    return ""


@contextlib.contextmanager
def long_body():
    """The main process is inside main_process_first's block: a peer's check waits on."""
    wd = _ACTIVE[0]
    if wd is None:
        yield
        return
    wd.long_body = True
    try:
        yield
    finally:
        wd.long_body = False
