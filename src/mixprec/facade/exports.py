"""Exports: a model's full weights out of the engine, whatever its sharding.

``get_state_dict`` gathers them (fp32 masters where there are, whole under tensor
parallelism; a collective only where something must be gathered), ``save_model`` writes
them as safetensors (split, with an index, above ``max_shard_size``), ``save_16bit_model``
in the compute dtype (DeepSpeed's call); ``gathered_parameters`` lets a loop read or
change the full values in place (engines/gathered.py). The files are written by the main
process (compat/export.py); every rank learns whether it worked.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..compat.export import parse_size, write_model, write_single
from ..distributed import collectives
from ..distributed import watchdog as desync
from ..engines import gathered
from ..parallel import tensor as tensor_parallel


class Exports:
    """Mixin of :class:`mixprec.Accelerator` (reads the engine, the policy and the state)."""

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """Full-precision state dict: parameters from the fp32 masters where there are, whole
        under tensor parallelism. A collective (every rank calls it) only where the weights
        must be gathered: zero3/fsdp, tensor parallelism, zero1/2 with low-precision stored
        parameters. Elsewhere (ddp, zero1/2 in fp32 storage) one rank may call it alone,
        e.g. under ``if accelerator.is_main_process:``, also after :meth:`end_training`."""
        if tensor_parallel.layout_of(model) is None and self.engine.comm.full_state_is_local(model):
            return self.engine.full_state_dict(model)
        if self._ended:
            raise RuntimeError(
                f"get_state_dict() after end_training(): {type(model).__name__}'s full weights are gathered from "
                f"the {self.backend} shards over the process group, which end_training() released; call "
                f"get_state_dict(model) (or save_pretrained/save_model) before accelerator.end_training()"
            )
        return self._gathered_state_dict(model)

    @desync.tracked("get_state_dict", desync.plain_signature)
    def _gathered_state_dict(self, model: nn.Module) -> dict:
        return tensor_parallel.full_state_dict(model, self.engine.full_state_dict(model))

    @desync.tracked("save_16bit_model")
    def save_16bit_model(self, model: nn.Module, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's call of the same name: the model's full weights, gathered from every
        TP, zero3 and fsdp shard, in the policy's compute dtype (bf16/fp16; fp32 under
        ``mixed_precision="no"``), written by the main process to ``save_dir/save_filename``
        (safetensors when the name ends in ``.safetensors``, ``torch.save`` otherwise),
        atomically. Every rank calls it; returns True once the file is written. The file
        loads with plain ``load_state_dict`` (or ``from_pretrained``), without mixprec.

        Example::

            accelerator.save_16bit_model(model, "export", "model.safetensors")
        """
        self._call_check(self.state, "save_16bit_model")
        state = self.get_state_dict(model)
        if exclude_frozen_parameters:
            frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        error = None
        if self.is_main_process:
            try:
                write_single(state, save_dir, save_filename, self.policy.compute_dtype)
            except (ValueError, OSError) as e:
                error = f"{type(e).__name__}: {e}"
        error = collectives.broadcast_object_list(self.state, [error])[0]
        if error is not None:
            raise ValueError(f"save_16bit_model({str(save_dir)!r}, {save_filename!r}) failed: {error}")
        return True

    def gathered_parameters(self, params_or_module, modifier_rank: Optional[int] = None,
                            writeback: bool = False, rank0_only: bool = False):
        """Context in which the full values of ``params_or_module`` (a prepared module, a
        parameter, or an iterable of parameters) are present and can be read or changed.

        A collective: every rank of the group enters it. zero3/fsdp gather the units holding
        them on entry and free them on exit; the other backends hold full parameters
        already. ``modifier_rank=r``: rank r's values are broadcast on exit and written to
        the fp32 masters (and shards) of every rank; ``writeback=True``: each rank writes
        back what it owns from its own values. ``rank0_only``: only rank 0 keeps the values
        inside. Optimizer state is untouched. Nested scopes gather once (docs/fsdp.md,
        [Note: the gathering context] in engines/gathered.py).

        Example::

            with accelerator.gathered_parameters(model.head, modifier_rank=0):
                torch.nn.init.zeros_(model.head.weight)
        """
        return gathered.scope_for(self.engine, params_or_module, modifier_rank=modifier_rank,
                                  writeback=writeback, rank0_only=rank0_only)

    @desync.tracked("save_model")
    def save_model(self, model: nn.Module, save_directory: str, max_shard_size: Union[int, str] = "10GB",
                   safe_serialization: bool = True, *, dtype: Union[str, torch.dtype, None] = None) -> str:
        """Write ``model``'s full weights (fp32 masters, cast to ``dtype`` if given) to
        ``save_directory/model.safetensors`` (``pytorch_model.bin`` with
        ``safe_serialization=False``), split into ``model-0000k-of-0000n.safetensors`` files
        plus an index when larger than ``max_shard_size`` (bytes, or ``"10GB"``, ``"500MiB"``).
        Call it on every process; the main process writes. Returns the file (or index) written.

        Example::

            accelerator.save_model(model, "export", dtype="bf16")
        """
        self._call_check(self.state, "save_model")
        limit = parse_size(max_shard_size)
        state = self.get_state_dict(model)
        out = None
        error = None
        if self.is_main_process:
            try:
                out = write_model(state, save_directory, limit, safe_serialization, dtype)
            except (ValueError, OSError) as e:
                error = f"{type(e).__name__}: {e}"
        error, out = collectives.broadcast_object_list(self.state, [error, out])
        if error is not None:
            raise ValueError(f"save_model({str(save_directory)!r}) failed: {error}")
        return str(out)
