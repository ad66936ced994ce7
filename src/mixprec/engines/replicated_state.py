"""Checkpoint shards of the replicated backends (single, ddp): every rank holds whole
tensors, so each is described once, whole and replicated (rank 0 writes it). The engine
contract (``Engine.state_shards`` / ``load_state_shards`` in engines/base.py) says what the
names and ranges mean; ``Comm.state_shards`` (engines/comm.py) calls these with the
engine's precision layer, which holds the fp32 masters. The ZeRO slices are in
engines/zero_state.py."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.format import Shard, model_prefix, numel_of


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
    """Read whole tensors (everything before changing anything), copy them into the fp32
    masters / parameters / buffers, refresh the low-precision parameters from the masters,
    and give each optimizer its state (keyed by parameter name)."""

    def whole(name: str) -> torch.Tensor:
        shape = read.index[name][0]
        return read(name, 0, numel_of(shape)).reshape(shape)

    staged, key_of = [], {}
    for i, model in enumerate(models):
        prefix = model_prefix(i)
        for name, t in model.state_dict(keep_vars=True).items():
            dst = precision.master_of.get(id(t), t)
            key_of.setdefault(id(dst), (name if prefix == "model/" else prefix + name))
            staged.append((dst, whole(prefix + name)))
    optim_states = []
    for j, optimizer in enumerate(optimizers):
        state, groups, index = {}, [], 0
        for group in optimizer.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(index, index + len(group["params"])))})
            for p in group["params"]:
                head = f"optim/{j}/{key_of[id(p)]}/"
                entries = {n[len(head):]: whole(n) for n in read.index if n.startswith(head) and "/" not in n[len(head):]}
                if entries:
                    state[index] = entries
                index += 1
        optim_states.append({"state": state, "param_groups": groups})
    with torch.no_grad():
        for dst, src in staged:
            dst.copy_(src)
        precision.refresh_lowp()
    for optimizer, sd in zip(optimizers, optim_states):
        optimizer.load_state_dict(sd)
