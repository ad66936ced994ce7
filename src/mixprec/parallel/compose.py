"""The one place where the parallelisms meet a model at ``prepare()``, in order.

[Note: the order of the parallelisms]
``compose(acc, model)`` applies, in this order and nowhere else:

1. activation checkpointing is *planned* (which modules; nothing changes yet), and sequence
   parallelism checks that the model can run Ulysses (a refusal before anything moves);
2. the weights exist on the device: a meta model is materialised (whole on ddp/zero1/2,
   under TP module by module inside the split, on zero3/fsdp a unit at a time as each unit's
   core is built, [Note: materialising a meta model shard by shard] in materialize.py;
   from its checkpoint when it has one, [Note: loading a shard, not the model] in
   pretrained.py), else moved;
3. tensor parallelism splits the model (hooks around the split modules' own forward) and
   gives the engine its placements ([Note: agreement over the mesh] in tensor/engine.py);
4. the engine prepares the split model over its group (the ranks holding the same TP slice;
   its forward context, casts, hooks);
5. sequence parallelism runs that forward context inside Ulysses (it needs the engine's
   context to exist, so it comes after the engine, and it does not touch parameters);
6. activation checkpointing is applied last ([Note: checkpointing by class swap] in
   mixprec/activation_checkpointing.py: its class swap wraps the forward the engine installed).

TP before the engine so the engine only ever sees the split parameters (its buckets, shards
and masters are the local slices); SP and checkpointing after it because both wrap the
forward the engine made.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import activation_checkpointing as act_ckpt
from . import materialize
from . import sequence as sequence_parallel
from . import tensor as tensor_parallel


def compose(acc: Any, model: nn.Module) -> None:
    """Prepare ``model`` for ``acc``'s engine, mesh and config ([Note: the order of the
    parallelisms])."""
    config = acc.config.config
    checkpointed = act_ckpt.plan(model, config.activation_checkpointing, acc.engine)
    if acc._ulysses is not None:
        sequence_parallel.check_model(model)
    tp = acc.mesh is not None and acc.mesh.tp_size > 1
    if materialize.has_meta(model) and not tp and not acc.engine.comm.shards_parameters:
        materialize.materialize(model, acc.device, acc.state.group)  # zero3/fsdp: a unit at a time
    if tp:
        if materialize.has_meta(model):
            for m in model.modules():  # the buffers (real); the meta parameters stay for the split
                for k, b in m._buffers.items():
                    if b is not None:
                        m._buffers[k] = b.to(acc.device)
        else:
            model.to(acc.device)
        tensor_parallel.prepare_model(model, acc.engine, acc.mesh, config.tensor_parallel, acc.state.group)
    acc.engine.prepare_model(model, acc._autocast_gate)
    if acc._ulysses is not None:
        sequence_parallel.prepare_model(model, acc._ulysses)
    act_ckpt.apply(checkpointed, config.activation_checkpointing.selective)
