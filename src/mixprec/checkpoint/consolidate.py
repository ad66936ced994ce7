"""One safetensors file of full weights, from a sharded checkpoint or from a live model.

``consolidate`` streams: it reads one global tensor at a time from whichever rank files
hold its slices and appends it to the output, so memory stays bounded by the largest
tensor and no process group is needed (``mixprec consolidate CKPT OUT.safetensors``).
Both functions refuse to write a tensor whose data does not cover its shape.

Example::

    consolidate("runs/a/checkpoints/checkpoint_3", "model.safetensors", dtype="bf16")
    safetensors.torch.load_file("model.safetensors")["0.weight"].dtype    # torch.bfloat16
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import format as fmt
from .reader import CheckpointReader


def _cast(dtype, source: torch.dtype) -> torch.dtype:
    """Floating tensors go to ``dtype``; integer/bool buffers keep theirs."""
    return dtype if dtype is not None and source.is_floating_point else source


def _atomic_write(out: Path, entries: list, produce, metadata: dict) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return fmt.atomic_write(out, lambda f: fmt.write_safetensors(f, entries, produce, metadata))


def consolidate(checkpoint, out, dtype=None, model: int = 0) -> Path:
    """Write model ``model``'s full state from ``checkpoint`` to the safetensors file ``out``.

    Keys are the model's ``state_dict`` keys; floating tensors are cast to ``dtype``
    (``"bf16"``, ``"fp16"``, ``"fp32"``, a torch dtype, or None to keep the saved dtype).
    """
    dtype = fmt.parse_dtype(dtype)
    reader = CheckpointReader(checkpoint)
    prefix = fmt.model_prefix(model)
    names = [n for n in reader.names(prefix) if "/" not in n[len(prefix):]]
    if not names:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} holds no tensors for model {model} (prefix {prefix!r}); "
            f"it holds {reader.metadata.get('num_models', 'these')} prefixes: "
            f"{sorted({n.split('/')[0] for n in reader.index})}"
        )
    entries = [(n[len(prefix):], reader.index[n][0], _cast(dtype, reader.index[n][1])) for n in names]

    def produce(i: int) -> torch.Tensor:
        shape, saved = reader.index[names[i]]
        flat = reader(names[i], 0, fmt.numel_of(shape))
        return flat.reshape(shape).to(entries[i][2])

    meta = {"format": "pt", "source": str(checkpoint), "policy": reader.metadata["policy"]["name"]}
    return _atomic_write(Path(out), entries, produce, meta)


def write_state_dict(state: dict, out, dtype=None) -> Path:
    """Write a full state dict (e.g. ``accelerator.get_state_dict(model)``) to ``out``.

    Refuses empty tensors: a 0-element tensor is what a sharded engine's local view looks
    like, never a real weight; gather the full state first.
    """
    dtype = fmt.parse_dtype(dtype)
    empty = [k for k, v in state.items() if v.numel() == 0]
    if empty:
        raise ValueError(
            f"refusing to write empty tensors {empty}: they would replace real weights. Pass the full "
            "state (accelerator.get_state_dict(model)), not a shard's local view"
        )
    keys = list(state)
    entries = [(k, tuple(state[k].shape), _cast(dtype, state[k].dtype)) for k in keys]
    return _atomic_write(Path(out), entries, lambda i: state[keys[i]].detach().to(entries[i][2]), {"format": "pt"})
