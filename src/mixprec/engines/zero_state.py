"""Checkpoint shards of the ZeRO engines: each rank describes exactly the slices it owns.

The engine contract (``Engine.state_shards`` / ``load_state_shards``, answered here for
``ShardedComm`` in engines/zero.py) names every global
tensor and the flat range a rank holds. A ZeRO rank owns, for every trainable parameter, at
most one contiguous piece of its fp32 master (``core.owned_ranges()``), and the optimizer
state of exactly those elements (the optimizer steps shard *segments*: runs of the shard
that belong to one param group). So the fp32 masters and the element-wise optimizer state
are written as slices by the rank that owns them, without any gather; buffers and frozen
parameters are replicated. The reader reassembles any range, so a checkpoint written by
zero2 on 4 ranks loads into ddp on 2, one process, or zero1 on 3.

[Note: step counters] torch keeps a scalar ``step`` per parameter. A rank that owns no piece
of a parameter has no state for it, yet ``step`` is saved as a replicated scalar (rank 0
writes it), so the per-group step is agreed first with one MAX all-reduce and every rank
describes the same value for every parameter of the group.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.format import Shard, model_prefix, state_names_by_head
from ..checkpoint.reader import read_into


def _names_by_id(model: nn.Module) -> dict[int, list[str]]:
    """Every state-dict name of each tensor of ``model`` (tied tensors have several)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, t in model.state_dict(keep_vars=True).items():
        names[id(t)].append(name)
    return names


def _owned(comm, models):
    """Per sharding core of each model (zero3/fsdp: one per unit):
    (prefix, model, core, params, names_by_id, [(index, shard_offset, param_offset, numel)]).
    The model's state dict is walked once, not once per core (that was quadratic in the
    number of units: 2 s of a save at 768 units)."""
    result = []
    for i, model in enumerate(models):
        names = _names_by_id(model)
        for core in comm.model_cores(model):
            params = core.params
            ranges = [(index, offset, param_offset, numel)
                      for index, _bucket, offset, param_offset, numel in core.owned_ranges() if numel > 0]
            result.append((model_prefix(i), model, core, params, names, ranges))
    return result


def _trainable_ids(owned, model) -> set[int]:
    return {id(p) for _prefix, m, _core, params, *_ in owned if m is model for p in params}


def _optimizer_layout(comm, optimizer, owned):
    """(segment master tensor, [(keys, param shape, param_offset, start_in_segment, numel)])"""
    master_base = {}
    for prefix, _model, core, params, names, ranges in owned:
        shard = core.master_shard
        master_base[shard.untyped_storage().data_ptr()] = (prefix, shard, params, names, ranges)
    layout = []
    for segment in comm.segments_of(optimizer):
        m = segment.master
        prefix, shard, params, names, ranges = master_base[m.untyped_storage().data_ptr()]
        seg_start = m.storage_offset() - shard.storage_offset()
        seg_end = seg_start + m.numel()
        pieces = []
        for index, offset, param_offset, numel in ranges:
            if seg_start <= offset and offset + numel <= seg_end:
                keys = [(n if prefix == "model/" else prefix + n) for n in names[id(params[index])]]
                pieces.append((keys, tuple(params[index].shape), param_offset, offset - seg_start, numel))
        layout.append((m, pieces))
    return layout


def _group_steps(comm, optimizer) -> list[float]:
    """Per param group, the step count every rank agrees on ([Note: step counters])."""
    steps = []
    for group in optimizer.param_groups:
        value = -1.0
        for p in group["params"]:
            s = optimizer.state.get(p, {}).get("step")
            if s is not None:
                value = float(s)
                break
        steps.append(value)
    # On the comm's device: NCCL moves device tensors only (a CPU tensor fails there).
    t = torch.tensor(steps, dtype=torch.float64, device=comm.device)
    if len(steps):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
    return t.tolist()


def zero_state_shards(comm, models, optimizers) -> list[Shard]:
    owned = _owned(comm, models)
    shards: list[Shard] = []
    for i, model in enumerate(models):
        trainable = _trainable_ids(owned, model)
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) not in trainable:
                v = t.detach()
                shards.append(Shard(model_prefix(i) + name, tuple(v.shape), v.dtype, 0, v.reshape(-1), True))
    for prefix, model, core, params, names, ranges in owned:
        master = core.master_shard
        for index, offset, param_offset, numel in ranges:
            p = params[index]
            for name in names[id(p)]:
                shards.append(Shard(prefix + name, tuple(p.shape), torch.float32, param_offset,
                                    master.narrow(0, offset, numel), False))
    for j, optimizer in enumerate(optimizers):
        steps = _group_steps(comm, optimizer)
        layout = _optimizer_layout(comm, optimizer, owned)
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        keys_in_group: dict[int, set] = defaultdict(set)
        for m, pieces in layout:
            state = optimizer.state.get(m, {})
            for keys, shape, param_offset, start, numel in pieces:
                keys_in_group[group_of[id(m)]].update(keys)
                for skey, value in state.items():
                    if skey == "step":
                        continue
                    if not isinstance(value, torch.Tensor) or value.numel() != m.numel():
                        raise ValueError(
                            f"optimizer {j} state {skey!r} is not element-wise (shape "
                            f"{tuple(getattr(value, 'shape', ()))} for a shard segment of {m.numel()} "
                            "elements); it cannot be saved per shard"
                        )
                    piece = value.detach().reshape(-1).narrow(0, start, numel)
                    for key in keys:
                        shards.append(Shard(f"optim/{j}/{key}/{skey}", shape, value.dtype, param_offset, piece, False))
        all_keys = [None] * len(steps)
        gathered = [None] * comm.world_size
        dist.all_gather_object(gathered, {g: sorted(k) for g, k in keys_in_group.items()}, group=comm.group)
        for part in gathered:
            for g, keys in part.items():
                all_keys[g] = sorted(set(all_keys[g] or []) | set(keys))
        for g, step in enumerate(steps):
            if step < 0:
                continue
            for key in all_keys[g] or []:
                shards.append(Shard(f"optim/{j}/{key}/step", (), torch.float32, 0,
                                    torch.tensor([step], dtype=torch.float32), True))
    return shards


def zero_load_state_shards(comm, models, optimizers, read) -> None:
    """Read this rank's slices straight into its master shard, its replicated buffers and its
    optimizer state ([Note: in-place load] in engines/replicated_state.py: the checkpoint
    was verified on every rank before this runs; the plan is made first, then each range is
    read into its destination). Optimizer state goes into the segment's existing state
    tensors when their size and dtype match, else into new ones; elements of a segment that
    no parameter owns are zero either way."""
    owned = _owned(comm, models)
    plan = []  # (destination tensor, checkpoint name, offset), read once the plan is whole
    for i, model in enumerate(models):
        trainable = _trainable_ids(owned, model)
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) not in trainable:
                plan.append((t, model_prefix(i) + name, 0))
    for prefix, model, core, params, names, ranges in owned:
        master = core.master_shard
        for index, offset, param_offset, numel in ranges:
            name = names[id(params[index])][0]
            plan.append((master.narrow(0, offset, numel), prefix + name, param_offset))
    new_states, gaps, by_head = [], [], state_names_by_head(read.index)
    for j, optimizer in enumerate(optimizers):
        for m, pieces in _optimizer_layout(comm, optimizer, owned):
            if not pieces:
                continue
            key = pieces[0][0][0]
            head = f"optim/{j}/{key}/"
            skeys = list(by_head.get(head, ()))
            if not skeys:
                continue
            current = optimizer.state.get(m, {})
            entry = {}
            for skey in skeys:
                if skey == "step":
                    entry["step"] = read(head + "step", 0, 1).reshape(()).to(torch.float32)
                    continue
                dtype = read.index[head + skey][1]
                old = current.get(skey)
                if (isinstance(old, torch.Tensor) and old.shape == m.shape and old.dtype == dtype
                        and old.device == m.device and old.is_contiguous()):
                    buf = old
                    gaps.append((buf, sorted((start, numel) for *_, start, numel in pieces)))
                else:
                    buf = torch.zeros(m.numel(), dtype=dtype, device=m.device)
                for keys, _shape, param_offset, start, numel in pieces:
                    plan.append((buf.narrow(0, start, numel), f"optim/{j}/{keys[0]}/{skey}", param_offset))
                entry[skey] = buf
            new_states.append((optimizer, m, entry))
    with torch.no_grad():
        for buf, pieces in gaps:  # a reused state tensor: what no piece covers is zero, as in a new one
            pos = 0
            for start, numel in pieces + [(buf.numel(), 0)]:
                if start > pos:
                    buf.narrow(0, pos, start - pos).zero_()
                pos = max(pos, start + numel)
        for dst, name, offset in plan:
            read_into(read, name, offset, dst)
        for _prefix, _model, core, *_ in owned:
            # zero1/2 all-gather the loaded masters into the parameters now; zero3/fsdp
            # gather them at the next forward.
            if not comm.options.shard_params:
                core.gather_params()
    for optimizer in optimizers:
        optimizer.state.clear()
    for optimizer, m, entry in new_states:
        optimizer.state[m] = entry
