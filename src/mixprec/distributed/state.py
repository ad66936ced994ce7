"""Who this process is in a multi-process job, and the process group that connects it.

Example::

    from mixprec.distributed import init_distributed, destroy_distributed
    state = init_distributed(torch.device("cpu"))   # reads RANK, WORLD_SIZE, MASTER_ADDR, ...
    try:
        if state.is_main_process:
            print(f"{state.num_processes} processes over {state.backend}")
    finally:
        destroy_distributed(state)

There is no process-global mixprec state: pass the returned :class:`DistributedState`
to the collectives (:mod:`mixprec.distributed.collectives`) and to
:func:`mixprec.data.shard_dataloader`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedState:
    """This process's place in the job. ``group`` is the torch ProcessGroup (``None`` on one
    process); ``backend`` is ``"gloo"``, ``"nccl"`` or ``None`` on one process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    backend: Optional[str] = None
    group: Any = None
    device: torch.device = torch.device("cpu")

    @property
    def num_processes(self) -> int:
        return self.world_size

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # [Note: pickling a state]
    # A ProcessGroup cannot be pickled. The state pickles the group's name instead; unpickling
    # finds the group of that name and size again in the unpickling process (the same process,
    # or another rank of the same job), else puts a DetachedGroup there, which raises a
    # RuntimeError naming the fix at its first use, not at unpickling.
    def __getstate__(self) -> dict:
        out = dict(self.__dict__)
        if out.get("group") is not None:
            out["group"] = GroupRef(_group_name(out["group"]), out["world_size"])
        return out

    def __setstate__(self, values: dict) -> None:
        values = dict(values)
        if isinstance(values.get("group"), GroupRef):
            values["group"] = values["group"].resolve()
        self.__dict__.update(values)  # frozen: bypasses the dataclass's __setattr__


@dataclasses.dataclass(frozen=True)
class GroupRef:
    """A process group by name, as pickled ([Note: pickling a state])."""

    name: Optional[str]
    world_size: int

    def resolve(self) -> Any:
        """The live group of this name and size, or a :class:`DetachedGroup`."""
        found = find_group(self.name)
        if found is not None and dist.get_world_size(found) == self.world_size:
            return found
        return DetachedGroup(self.name, self.world_size)


class DetachedGroup:
    """Stands for the process group of an unpickled state in a process that has no group of
    that name and size: any use raises a RuntimeError naming the fix."""

    def __init__(self, name: Optional[str], world_size: int) -> None:
        object.__setattr__(self, "_ref", (name, world_size))

    def __reduce__(self):
        return (DetachedGroup, self._ref)

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr == "_ref":
            raise AttributeError(attr)
        name, world = self._ref
        raise RuntimeError(
            f"this object was unpickled in a process without its process group ({name!r}, {world} "
            f"processes): it cannot communicate. Unpickle it in a process of the same job (after the "
            f"job's process group is initialised, e.g. under `mixprec launch`), or make a new Accelerator there"
        )

    def __repr__(self) -> str:
        return f"DetachedGroup(name={self._ref[0]!r}, world_size={self._ref[1]})"


def _group_name(group: Any) -> Optional[str]:
    try:
        return group.group_name
    except (AttributeError, RuntimeError):
        return None


def find_group(name: Optional[str]) -> Any:
    """The live process group named ``name`` in this process, or None."""
    if name is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.group.WORLD.group_name == name:
        return dist.group.WORLD
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", {})
    return next((pg for pg, n in names.items() if n == name), None)


def _env_int(name: str, *, default: Optional[int] = None, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ValueError(
                f"environment variable {name} is not set but WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                f"asks for a multi-process run; start the script with `mixprec launch` (or torchrun), "
                f"which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; set it to an int >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} must be >= {minimum}")
    return value


def _env_str(name: str) -> str:
    raw = os.environ.get(name)
    if not raw:
        raise ValueError(
            f"environment variable {name} is not set but WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} asks for "
            f"a multi-process run; start the script with `mixprec launch` (or torchrun), or export {name}"
        )
    return raw


def init_distributed(
    device: torch.device, *, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    backend: Optional[str] = None,
) -> DistributedState:
    """Join the job described by the environment and return this process's state.

    With ``WORLD_SIZE`` unset or 1 this returns a single-process state and touches nothing.
    Otherwise it initialises torch's default process group from ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (Gloo for a CPU ``device``, NCCL for CUDA, where the
    current CUDA device is set from ``LOCAL_RANK`` first). An already initialised default
    group is reused (its backend and size must match the environment).

    [Note: ranks sharing a GPU]
    NCCL needs one device per rank, so with CUDA and no device index, ``LOCAL_RANK`` must be
    below ``torch.cuda.device_count()``; otherwise this raises naming both (before any CUDA
    call, instead of the CUDA error of ``set_device(cuda:LOCAL_RANK)``). Gloo moves CUDA
    tensors through the host, so ranks may share devices: with ``backend="gloo"``, or an
    already initialised Gloo default group (the test harness's, see
    src/mixprec/distributed/spawn.py), rank ``LOCAL_RANK`` uses ``cuda:(LOCAL_RANK %
    device_count)``: two ranks on one GPU (benchmarks/gpu_check.py's world=2 cases).
    ``backend`` (``"nccl"`` or ``"gloo"``; default: NCCL for CUDA, Gloo for the CPU) picks the
    group's backend when this call creates it.

    Example::

        state = init_distributed(torch.device("cuda"))  # cuda:LOCAL_RANK under `mixprec launch`
    """
    device = torch.device(device)
    world_size = _env_int("WORLD_SIZE", default=1, minimum=1)
    if world_size == 1:
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return DistributedState(device=device)
    if not dist.is_available():
        raise RuntimeError(
            f"WORLD_SIZE={world_size} asks for a multi-process run but this torch build has no "
            f"torch.distributed; install a torch wheel with distributed support"
        )
    rank = _env_int("RANK")
    if rank >= world_size:
        raise ValueError(f"environment variable RANK={rank} must be < WORLD_SIZE={world_size}")
    local_rank = _env_int("LOCAL_RANK", default=rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", default=world_size, minimum=1)
    if local_rank >= local_world_size:
        raise ValueError(
            f"environment variable LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world_size}"
        )
    node_rank = _env_int("GROUP_RANK", default=rank // local_world_size)
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not supported; use 'nccl' (CUDA) or 'gloo' (CPU, or CUDA "
                         f"tensors through the host) or None for the device's default")
    existing = str(dist.get_backend()) if dist.is_initialized() else None
    if backend is not None and existing is not None and existing != backend:
        raise ValueError(f"backend={backend!r} was asked for but the default process group already uses "
                         f"{existing!r}; pass backend={existing!r} (or None), or destroy the group first")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device} was asked for but CUDA is not available; pass torch.device('cpu')")
        backend = backend or existing or "nccl"
        device = _cuda_device_for(device, local_rank, backend)
        torch.cuda.set_device(device)
    elif device.type == "cpu":
        if backend == "nccl":
            raise ValueError("backend='nccl' needs CUDA tensors but device is the CPU; pass "
                             "backend='gloo' (or None) or a 'cuda' device")
        backend = "gloo"
    else:
        raise ValueError(f"device={device} is not supported for multi-process runs; use a 'cpu' or 'cuda' device")

    if dist.is_initialized():
        existing = dist.get_backend()
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"the default process group is already initialised with rank={dist.get_rank()}, "
                f"world_size={dist.get_world_size()} but the environment says RANK={rank}, "
                f"WORLD_SIZE={world_size}; destroy it first (torch.distributed.destroy_process_group())"
            )
        backend = str(existing)
    else:
        _env_str("MASTER_ADDR")
        _env_int("MASTER_PORT", minimum=1)
        dist.init_process_group(
            backend=backend,
            store=_fresh_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
    return DistributedState(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        backend=backend,
        group=dist.group.WORLD,
        device=device,
    )


# [Note: a fresh store prefix per process group]
# torch's env:// rendezvous keeps one TCPStore server per port in a process (multi-tenant),
# alive while anything holds a store of it, and after destroy_process_group() it names the
# next default group "0" again: the new group's Gloo/NCCL rendezvous reads and writes the
# same keys as the last one's. A group that is still referenced (the Accelerator that ended
# its training, while the next one is built: `acc = Accelerator(...)` twice in a loop or a
# notebook) keeps the server and those keys alive, so a rank could read its peer's address
# from the previous group before the peer wrote the new one, and both ranks then waited in
# their first collective for ever. Every default group mixprec creates gets its own key
# prefix, "mixprec/<n>" for the n-th in this process: every rank creates the same groups in
# the same order, so they agree on n, and no group reads another's keys.
_GROUPS_CREATED = [0]


def _fresh_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The env:// rendezvous store (MASTER_ADDR/MASTER_PORT, as torch's ``init_method="env://"``
    makes it) under a prefix of its own ([Note: a fresh store prefix per process group])."""
    from .rendezvous import HOSTED_STORE_ENV

    if os.environ.get(HOSTED_STORE_ENV) == "1":  # the parent hosts it ([Note: a store bound where it is asked to listen])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False, timeout)
    else:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    _GROUPS_CREATED[0] += 1
    return dist.PrefixStore(f"mixprec/{_GROUPS_CREATED[0]}", store)


def _cuda_device_for(device: torch.device, local_rank: int, backend: str) -> torch.device:
    """The CUDA device of this rank ([Note: ranks sharing a GPU])."""
    count = torch.cuda.device_count()
    if device.index is not None:
        if device.index >= count:
            raise ValueError(f"device={device} was asked for but this machine has {count} CUDA device(s) "
                             f"(cuda:0..cuda:{count - 1}); pass an index below {count}")
        return device
    if local_rank < count:
        return torch.device("cuda", local_rank)
    if backend == "gloo":
        return torch.device("cuda", local_rank % count)  # ranks share the device (Gloo only)
    raise ValueError(
        f"LOCAL_RANK={local_rank} would use cuda:{local_rank} but this machine has {count} CUDA "
        f"device(s) (torch.cuda.device_count()={count}) and NCCL needs one device per rank. Fix: "
        f"start at most {count} process(es) per node (--nproc-per-node {count}), or let ranks "
        f"share a device over Gloo (init_distributed(device, backend='gloo'), or initialise a Gloo "
        f"default group first)"
    )


def init_single_process_group(state: DistributedState, *, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> DistributedState:
    """A one-process group for ``state`` (world size 1), so the distributed backends (ddp,
    zero1-3, fsdp) run unchanged in a single process: Gloo for the CPU, NCCL for CUDA, with
    an in-memory store (no address or port needed). An existing one-process default group
    is reused."""
    if state.world_size != 1:
        raise ValueError(f"init_single_process_group() needs world size 1, got {state.world_size}")
    device = state.device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"the default process group has {dist.get_world_size()} ranks but WORLD_SIZE is 1")
        backend = str(dist.get_backend())
    else:
        if not dist.is_available():
            raise RuntimeError("this torch build has no torch.distributed; use backend='single'")
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, device_id=device if backend == "nccl" else None)
    return dataclasses.replace(state, backend=backend, group=dist.group.WORLD)


# [Note: exit after a collective]
# A Gloo worker thread drops its reference to a finished collective (and so to the tensors
# it read or wrote) just after the caller's wait() returns. When that was the last reference
# to a tensor that Python once saw, the worker takes the GIL to release the Python object.
# If the main thread has reached interpreter finalization by then, CPython ends the worker
# thread with pthread_exit, whose forced unwind meets a noexcept frame in c10d:
# "terminate called without an active exception", exit code 134 after a run that
# succeeded. Giving up the GIL for a moment after the last collective lets every such worker
# finish while the interpreter is still alive (it needs the GIL once, for microseconds).
_GIL_HANDOFF_S = 0.05


def let_collective_workers_finish() -> None:
    """Release the GIL briefly so c10d worker threads can drop their last tensor references
    before the interpreter shuts down ([Note: exit after a collective])."""
    time.sleep(_GIL_HANDOFF_S)


def destroy_distributed(state: DistributedState) -> None:
    """Tear down the process group ``state`` uses (a no-op on one process or when it is gone)."""
    if state.group is not None and dist.is_available() and dist.is_initialized():
        let_collective_workers_finish()
        dist.destroy_process_group()
        let_collective_workers_finish()
