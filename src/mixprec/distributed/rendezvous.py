"""What ``mixprec launch`` shares between nodes through the rendezvous store: which nodes
have joined, and the job's first failure.

The store is the c10d ``TCPStore`` that torchelastic's static rendezvous starts in the
launcher of node 0 at ``--master-addr:--master-port``; every launcher and every rank can
reach it (the ranks' process group uses it too), so it needs no extra port.

[Note: failures across nodes]
Each launcher only sees its own node's ranks. Without help, a rank that raises on node 1
ends node 1's job, while node 0's ranks wait in a collective until the desync watchdog
blames the missing rank (or Gloo reports a closed connection), and the real error appears
nowhere on node 0. So the first failure is published:

* a rank that raises (the launcher's bootstrap, src/mixprec/launch.py) writes its record
  (rank, node, local rank, pid, exception type, message, the last frames of its traceback)
  under ``FAILURE_KEY`` with ``compare_set``: the first record written stays, so every node
  agrees on which failure was first; a later failure (a consequence, e.g. a collective that
  lost its peer) finds the key taken and says it failed after that rank;
* a rank that dies without a traceback (SIGKILL, a native crash) is published by its own
  launcher's supervisor, which sees it die;
* every launcher's supervisor polls the key; a failure from another node is claimed as
  this node's first failure, this node's ranks are stopped (SIGTERM, SIGKILL after
  ``--kill-after``), and the summary prints the published traceback as the cause;
* the ranks' desync watchdogs (src/mixprec/distributed/watchdog.py) read the key before
  they blame anyone: with a published failure of another rank they stop with
  :class:`~mixprec.errors.PeerFailedError` quoting it instead of a desync verdict.

The key is read with ``check`` (no wait), so polling it costs one store round trip.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import threading
import time
from typing import Callable, Optional, TextIO

FAILURE_KEY = "mixprec/launch/first_failure"
NODE_KEY = "mixprec/launch/node/{}"  # set by each node's launcher once it reaches the store
TRACEBACK_LINES = 40  # the last lines of a traceback kept in a published record


def connect(addr: str, port: int, timeout_s: float):
    """A client of the store at ``addr:port`` (it does not count as a rendezvous worker);
    raises when nothing answers within ``timeout_s``."""
    import torch.distributed as dist

    return dist.TCPStore(addr, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


# [Note: a store bound where it is asked to listen]
# torch's TCPStore server binds every interface ("*:<port>", IPv6 and IPv4) whatever host
# name it is given, and a port chosen by binding port 0, closing it and handing the number
# on can be taken by another process before the store binds it again (EADDRINUSE: seen in
# the suite, two test files starting ranks at once). ``host_store`` binds the listening
# socket itself, on the address asked for only, at port 0 when no port is given (the kernel
# picks a free one in the same call that binds it: nothing can take it in between), and
# hands the socket to the server (``master_listen_fd``). The ranks then join as clients:
# the store's lifetime is its host's, and no rank has to win a bind race. Two switches say
# so to a rank:
# - ``MIXPREC_HOSTED_STORE=1`` (HOSTED_STORE_ENV): mixprec's ``init_distributed`` joins the
#   store at MASTER_ADDR:MASTER_PORT as a client. Only mixprec reads it, so a function run
#   by ``run_distributed`` that makes a group of its own (``init_process_group`` with its own
#   ``tcp://`` address: benchmarks/bench_tp.py does) makes it as torch always does;
# - ``TORCHELASTIC_USE_AGENT_STORE=True`` (AGENT_STORE_ENV): torch's own switch for a store
#   hosted by the launcher, which ``mixprec launch``'s agent sets as torchrun's does; a test
#   that starts whole scripts (Accelerate's among them) as a launcher would sets it too
#   (``agent_store_env(port, torch_agent=True)``).
# torch's store has no authentication: whoever reaches the port can read and write it.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
HOSTED_STORE_ENV = "MIXPREC_HOSTED_STORE"


def host_store(addr: str = "127.0.0.1", port: int = 0, *, world_size: Optional[int] = None,
               wait_for_workers: bool = False, timeout_s: float = 300.0):
    """A TCPStore server listening on ``addr:port`` only ([Note: a store bound where it is
    asked to listen]); ``port=0`` takes a free port atomically. Returns the store; its
    ``.port`` is the port bound. ``world_size``/``wait_for_workers`` as in ``TCPStore``
    (the server counts as one worker). Raises ``OSError`` naming the address when the bind
    fails (EADDRINUSE for a taken port, EADDRNOTAVAIL for an address of another host)."""
    import torch.distributed as dist

    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover, not a listener
        try:
            sock.bind(sockaddr)
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {addr}:{port} for the rendezvous store: {e.strerror}") from None
        sock.listen(4096)
        bound = sock.getsockname()[1]
        store = dist.TCPStore(addr, bound, world_size, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=wait_for_workers, master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the server owns the descriptor now (it closes it when it stops)
    return store


def agent_store_env(port: int, addr: str = "127.0.0.1", *, torch_agent: bool = False) -> dict:
    """The environment that makes ranks join a store hosted by their parent (``host_store``):
    mixprec's ``init_distributed`` always, torch's ``env://`` rendezvous too with
    ``torch_agent`` ([Note: a store bound where it is asked to listen])."""
    env = {"MASTER_ADDR": addr, "MASTER_PORT": str(port), HOSTED_STORE_ENV: "1"}
    if torch_agent:
        env[AGENT_STORE_ENV] = "True"
    return env


# [Note: the launcher's store]
# ``mixprec launch`` runs torchelastic's static rendezvous, whose node-0 agent starts the
# TCPStore that every launcher and rank joins. torch's static handler binds it on every
# interface at a port fixed before the agent starts. mixprec's handler (LAUNCH_RDZV_BACKEND,
# registered by ``register_launch_rendezvous``) is that handler with the store from
# ``host_store``:
# - on one node (the default ``--master-addr 127.0.0.1``) it listens on loopback only, at a
#   port the kernel picks in the bind itself when ``--master-port`` is omitted: no other
#   host can reach it and no other process can take the port first;
# - with ``--nnodes > 1``, node 0 listens on ``--master-addr`` only (the address the other
#   nodes dial); where that is not an address of node 0 itself (a NAT'd or floating
#   address), on every interface, as torchrun does, and says so.
# The ranks learn the bound port from the rendezvous (MASTER_PORT) and join as clients.
LAUNCH_RDZV_BACKEND = "mixprec-static"


def _launch_handler(params):
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler

    class BoundStaticRendezvous(StaticTCPRendezvous):
        """torch's static rendezvous with node 0's store bound by :func:`host_store`."""

        def get_backend(self) -> str:
            return LAUNCH_RDZV_BACKEND

        def next_rendezvous(self):
            if not self._store:
                timeout_s = self.timeout.total_seconds()
                if self.rank != 0:
                    self._store = TCPStore(self.master_addr, self.master_port, self.world_size, False,
                                           self.timeout, multi_tenant=True)
                else:
                    try:
                        self._store = host_store(self.master_addr, self.master_port, world_size=self.world_size,
                                                 wait_for_workers=True, timeout_s=timeout_s)
                    except OSError as e:
                        import errno

                        if e.errno != errno.EADDRNOTAVAIL or self.world_size == 1:
                            raise
                        print(f"[mixprec launch] node 0: --master-addr {self.master_addr} is not an address of "
                              f"this host; the rendezvous store listens on every interface at port "
                              f"{self.master_port}", file=sys.stderr, flush=True)
                        self._store = host_store("0.0.0.0", self.master_port, world_size=self.world_size,
                                                 wait_for_workers=True, timeout_s=timeout_s)
                    self.master_port = self._store.port
            return RendezvousInfo(PrefixStore(self.run_id, self._store), self.rank, self.world_size,
                                  RendezvousStoreInfo(self.master_addr, self.master_port))

    base = create_rdzv_handler(params)
    return BoundStaticRendezvous(base.master_addr, base.master_port, base.rank, base.world_size, base.run_id,
                                 int(base.timeout.total_seconds()))


def register_launch_rendezvous() -> str:
    """Register mixprec's static rendezvous with torchelastic (idempotent); returns its name
    ([Note: the launcher's store])."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LAUNCH_RDZV_BACKEND, _launch_handler)
    return LAUNCH_RDZV_BACKEND


def failure_record(*, rank: int, local_rank: int, node_rank: int, pid: int, exc: Optional[BaseException],
                   traceback_text: Optional[str], reason: str) -> dict:
    """The record of a failed rank, as published and as printed by :func:`describe`."""
    tb = None
    if traceback_text:
        lines = traceback_text.rstrip("\n").splitlines()
        if len(lines) > TRACEBACK_LINES:
            lines = ["Traceback (most recent call last, earlier frames left out):", *lines[-TRACEBACK_LINES:]]
        tb = "\n".join(lines) + "\n"
    return {
        "rank": rank, "local_rank": local_rank, "node_rank": node_rank, "pid": pid,
        "type": type(exc).__name__ if exc is not None else None,
        "message": str(exc)[:2000] if exc is not None else None,
        "traceback": tb, "reason": reason, "time": time.time(),
    }


def publish_failure(store, record: dict) -> dict:
    """Record ``record`` as the job's first failure unless one is recorded; return the one
    that holds (``record`` itself when it was first)."""
    raw = json.dumps(record)
    current = store.compare_set(FAILURE_KEY, "", raw)
    return json.loads(current)


def read_failure(store) -> Optional[dict]:
    """The published first failure, or None (one round trip, no wait)."""
    if not store.check([FAILURE_KEY]):
        return None
    return json.loads(store.get(FAILURE_KEY))


def describe(record: dict) -> str:
    """``rank 1 (node 1, local rank 0, pid 4242) raised RuntimeError: boom on node 1``."""
    where = f"rank {record['rank']} (node {record['node_rank']}, local rank {record['local_rank']}, pid {record['pid']})"
    if record.get("type"):
        message = (record.get("message") or "").splitlines()
        return f"{where} raised {record['type']}: {message[0] if message else ''}"
    return f"{where} {record.get('reason', 'failed')}"


class JoinWatch(threading.Thread):
    """[Note: a launcher that speaks while it waits]
    Until this node's ranks start, say how many nodes are still missing, at once and then
    every ``interval_s`` seconds (and whenever the count changes)::

        [mixprec launch] node 0: waiting for 1 of 2 nodes at 127.0.0.1:29500 (timeout 900 s, waited 10 s)

    A node other than 0 that cannot reach the store says so ("nothing answers there yet"):
    a wrong address or port looks like that too. Each launcher marks itself joined with
    ``NODE_KEY``; the store's own count of rendezvous workers cannot be read from outside."""

    def __init__(self, addr: str, port: int, node_rank: int, nnodes: int, timeout_s: float,
                 started: Callable[[], bool], interval_s: float = 10.0, out: TextIO = sys.stderr) -> None:
        super().__init__(name="mixprec-join-watch", daemon=True)
        self.addr, self.port = addr, port
        self.node_rank, self.nnodes = node_rank, nnodes
        self.timeout_s = timeout_s
        self.started = started  # True once this node's ranks exist
        self.interval_s = interval_s
        self.out = out
        self.spoke = False  # a waiting line was printed (then "all joined" follows)
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def _say(self, text: str) -> None:
        print(f"[mixprec launch] node {self.node_rank}: {text}", file=self.out, flush=True)
        self.spoke = True

    def run(self) -> None:
        t0 = time.monotonic()
        store = None
        last: tuple = (None, -float("inf"))  # (what was said, when)
        while not self._halt.wait(0.2):
            if self.started():
                if self.spoke:
                    self._say(f"all {self.nnodes} nodes joined; starting this node's ranks")
                return
            waited = time.monotonic() - t0
            try:
                if store is None:
                    # A plain socket first: a TCPStore client retries a refused connection
                    # until its timeout, logging every try from C++.
                    socket.create_connection((self.addr, self.port), timeout=1.0).close()
                    store = connect(self.addr, self.port, timeout_s=1.0)
                    store.set(NODE_KEY.format(self.node_rank), "1")
                joined = sum(store.check([NODE_KEY.format(r)]) for r in range(self.nnodes))
                state = f"waiting for {self.nnodes - joined} of {self.nnodes} nodes"
            except Exception:  # noqa: BLE001 - nothing listens yet (or the store went away)
                store = None
                state = "waiting for node 0: nothing answers there yet"
                joined = None
            if joined == self.nnodes:
                continue  # every node is in; the ranks start in a moment
            if state != last[0] or time.monotonic() - last[1] >= self.interval_s:
                if last[0] is None and waited < 1.0 and store is None:
                    continue  # node 0's own store is still starting: give it a moment
                self._say(f"{state} at {self.addr}:{self.port} (timeout {self.timeout_s:g} s, waited {waited:.0f} s)")
                last = (state, time.monotonic())


__all__ = ["AGENT_STORE_ENV", "FAILURE_KEY", "HOSTED_STORE_ENV", "JoinWatch", "LAUNCH_RDZV_BACKEND", "agent_store_env", "connect",
           "host_store", "register_launch_rendezvous", "describe", "failure_record", "publish_failure", "read_failure"]
