"""Exports: a model's full weights out of the engine, whatever its sharding.

``get_state_dict`` gathers them (fp32 masters where there are, whole under tensor
parallelism; a collective only where something must be gathered), ``save_model`` writes
them as safetensors (split, with an index, above ``max_shard_size``), ``save_16bit_model``
in the compute dtype (DeepSpeed's call); ``gathered_parameters`` lets a loop read or
change the full values in place (engines/gathered.py). The files are written by the main
process (compat/export.py); every rank learns whether it worked.

[Note: saves stream, get_state_dict holds]
``get_state_dict`` returns the whole model, so the ranks it returns on hold it (on
zero3/fsdp every rank, as the model is gathered for each). The saves never call it:
``save_model``, ``save_16bit_model`` and a prepared Hugging Face model's ``save_pretrained``
(:func:`save_pretrained_streamed`) write from a
:class:`~mixprec.engines.streamed.FullStateStream`, one tensor gathered, written and
dropped at a time ([Note: streaming a model's full weights] in engines/streamed.py), the
same bits ``get_state_dict`` would give. A zero3/fsdp rank then holds its shard plus about
one tensor (the main process: the tensor and its cast copy); tests/distributed/
test_streaming_save.py measures it (docs/zero.md, "Saving a large model"). The main process
writes; a failure there (a full disk) stops its writing, not its part of the gathers
(``stream.drain()``), and is then broadcast, so every rank raises it and none is left
waiting in a gather.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..compat import export
from ..distributed import collectives
from ..distributed import watchdog as desync
from ..engines import gathered
from ..engines.streamed import FullStateStream
from ..parallel import tensor as tensor_parallel
from ..parallel.materialize import trim_heap


class Exports:
    """Mixin of :class:`mixprec.Accelerator` (reads the engine, the policy and the state)."""

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """Full-precision state dict: parameters from the fp32 masters where there are, whole
        under tensor parallelism. A collective (every rank calls it) only where the weights
        must be gathered: zero3/fsdp, tensor parallelism, zero1/2 with low-precision stored
        parameters. Elsewhere (ddp, zero1/2 in fp32 storage) one rank may call it alone,
        e.g. under ``if accelerator.is_main_process:``, also after :meth:`end_training`."""
        if self._state_is_local(model):
            return self.engine.full_state_dict(model)
        self._check_not_ended(model, "get_state_dict")
        return self._gathered_state_dict(model)

    def _state_is_local(self, model: nn.Module) -> bool:
        return tensor_parallel.layout_of(model) is None and self.engine.comm.full_state_is_local(model)

    def _check_not_ended(self, model: nn.Module, call: str) -> None:
        if self._ended and not self._state_is_local(model):
            raise RuntimeError(
                f"{call}() after end_training(): {type(model).__name__}'s full weights are gathered from "
                f"the {self.backend} shards over the process group, which end_training() released; call "
                f"get_state_dict(model) (or save_pretrained/save_model) before accelerator.end_training()"
            )

    def _stream_save(self, model: nn.Module, names: Optional[list], write: Callable[[FullStateStream], Any],
                     what: str, writes: Optional[bool] = None) -> Any:
        """``write(stream)`` on the main process (or where ``writes``), over a stream of
        ``model``'s full tensors ([Note: saves stream, get_state_dict holds]); returns what it
        returned, on every rank. A failure there is raised on every rank, after the gathers
        it skipped have run."""
        self._check_not_ended(model, what.partition("(")[0])
        stream = FullStateStream(self.engine, model, names, dst=0)
        # The stream delivers to the main process (rank 0), where transformers writes too.
        writes = stream.receives and (self.is_main_process if writes is None else writes)
        error = out = None
        failure: Optional[BaseException] = None
        if writes:
            try:
                out = write(stream)
            except Exception as e:  # noqa: BLE001 - every rank learns of it below
                error, failure = f"{type(e).__name__}: {e}", e
        if failure is not None and stream.broken:
            raise failure  # a gather failed: the ranks are no longer matched, nothing to agree on
        stream.drain()
        trim_heap()  # the last tensors' memory goes back too ([Note: the heap between tensors])
        error, out = collectives.broadcast_object_list(self.state, [error, out])
        if failure is not None and not isinstance(failure, (ValueError, OSError)):
            raise failure
        if error is not None:
            raise ValueError(f"{what} failed: {error}") from failure
        return out

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
        names = list(model.state_dict(keep_vars=True))
        if exclude_frozen_parameters:
            frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
            names = [k for k in names if k not in frozen]
        dtype = self.policy.compute_dtype

        def write(stream: FullStateStream) -> None:
            export.write_single_streamed(save_dir, save_filename, stream.entries, stream.take, dtype)

        self._stream_save(model, names, write, f"save_16bit_model({str(save_dir)!r}, {save_filename!r})")
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
        limit = export.parse_size(max_shard_size)

        def write(stream: FullStateStream) -> str:
            return str(export.write_model_streamed(save_directory, stream.entries, stream.take, limit,
                                                   safe_serialization, dtype))

        return self._stream_save(model, None, write, f"save_model({str(save_directory)!r})")


@desync.tracked("save_pretrained", desync.plain_signature)
def save_pretrained_streamed(acc: Any, model: nn.Module, save_directory, options: dict) -> bool:
    """A prepared Hugging Face model's ``save_pretrained`` (zero3/fsdp/TP), streamed: the
    same files as transformers' own (config, generation config, weights split by
    ``max_shard_size`` with its index, tied and ignored keys dropped), written by the rank
    transformers writes on, one tensor at a time ([Note: save_pretrained of a sharded model]
    in wrappers/model.py). ``options``: the call's arguments by name. Returns False, having
    done nothing, where transformers' save must see the whole state dict
    (:func:`~mixprec.compat.export.pretrained_unsupported`); every rank decides alike."""
    if export.pretrained_unsupported(model, options) is not None or os.path.isfile(save_directory):
        return False
    acc._call_check(acc.state, "save_pretrained")
    directory = Path(save_directory)
    os.makedirs(directory, exist_ok=True)
    entries = FullStateStream(acc.engine, model).entries  # names, shapes, dtypes: nothing gathered
    plan = export.pretrained_plan(model, entries, options)
    export.mark_pretrained_config(model)
    writes = model.should_save_on_this_rank(options.get("is_main_process", True))

    def write(stream: FullStateStream) -> str:
        export.write_pretrained_config(model, directory)
        return str(export.write_pretrained_weights(directory, plan, stream.entries, stream.take))

    acc._stream_save(model, plan.names, write, f"save_pretrained({str(save_directory)!r})", writes=writes)
    return True
