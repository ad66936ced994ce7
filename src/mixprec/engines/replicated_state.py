"""Checkpoint shards of the replicated backends (single, ddp): every rank holds whole
tensors, so each is described once, whole and replicated (rank 0 writes it). The engine
contract (``Engine.state_shards`` / ``load_state_shards`` in engines/base.py) says what the
names and ranges mean; ``Comm.state_shards`` (engines/comm.py) calls these with the
engine's precision layer, which holds the fp32 masters. The ZeRO slices are in
engines/zero_state.py."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.format import Shard, model_prefix, state_names_by_head
from ..checkpoint.reader import read_into


def replicated_state_shards(precision, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list:
    """Whole tensors: parameters as their fp32 masters where there are, buffers, and each
    optimizer's state keyed by its parameter's name."""
    shards, key_of = [], {}
    for i, model in enumerate(models):
        prefix = model_prefix(i)
        for name, t in model.state_dict(keep_vars=True).items():
            src = precision.master_of.get(id(t), t)
            key_of.setdefault(id(src), (name if prefix == "model/" else prefix + name))
            src = src.detach()
            shards.append(Shard(prefix + name, tuple(src.shape), src.dtype, 0, src.reshape(-1), True))
    for j, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                key = key_of.get(id(p))
                if key is None:
                    raise ValueError(
                        f"optimizer {j} holds a parameter of shape {tuple(p.shape)} that belongs "
                        "to no prepared model; prepare the model that owns it before saving"
                    )
                for skey, value in optimizer.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        if not isinstance(value, (int, float, bool)):
                            raise ValueError(
                                f"optimizer {j} state {key}/{skey} is a {type(value).__name__} "
                                f"({value!r}); checkpoints hold tensors and numbers only"
                            )
                        value = torch.tensor(value)
                    v = value.detach()
                    shards.append(Shard(f"optim/{j}/{key}/{skey}", tuple(v.shape), v.dtype, 0, v.reshape(-1), True))
    return shards


def replicated_load_state_shards(precision, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                                 read) -> None:
    """Read whole tensors straight into the fp32 masters / parameters / buffers and the
    optimizers' existing state tensors, refresh the low-precision parameters from the
    masters, and give each optimizer its state (keyed by parameter name).

    [Note: in-place load] The checkpoint was verified, on every rank, before this is called
    ([Note: verified shares] in checkpoint/reader.py), so nothing is staged: the plan (which
    name goes into which tensor) is made first, where every lookup that can fail happens, and
    then each tensor is read into its destination (``read_into``: a ``pread`` into memory
    already mapped, no copy, no page faults). Optimizer state is read into the tensors the
    optimizer already holds when their shape and dtype match (an optimizer that has stepped),
    and into new tensors otherwise, then handed over with ``load_state_dict`` as before.
    """
    plan, key_of = [], {}  # (destination tensor, checkpoint name)
    for i, model in enumerate(models):
        prefix = model_prefix(i)
        for name, t in model.state_dict(keep_vars=True).items():
            dst = precision.master_of.get(id(t), t)
            key_of.setdefault(id(dst), (name if prefix == "model/" else prefix + name))
            plan.append((dst, prefix + name))
    optim_states, by_head = [], state_names_by_head(read.index)
    for j, optimizer in enumerate(optimizers):
        state, groups, index = {}, [], 0
        for group in optimizer.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(index, index + len(group["params"])))})
            for p in group["params"]:
                head = f"optim/{j}/{key_of[id(p)]}/"
                current = optimizer.state.get(p, {})
                entries = {}
                for skey, n in by_head.get(head, {}).items():
                    shape, dtype = read.index[n]
                    old = current.get(skey)
                    reuse = (isinstance(old, torch.Tensor) and tuple(old.shape) == tuple(shape) and old.dtype == dtype
                             and old.is_contiguous())
                    dst = old if reuse else torch.empty(shape, dtype=dtype)
                    entries[skey] = dst
                    plan.append((dst, n))
                if entries:
                    state[index] = entries
                index += 1
        optim_states.append({"state": state, "param_groups": groups})
    with torch.no_grad():
        for dst, name in plan:
            read_into(read, name, 0, dst)
        precision.refresh_lowp()
    for optimizer, sd in zip(optimizers, optim_states):
        optimizer.load_state_dict(sd)
