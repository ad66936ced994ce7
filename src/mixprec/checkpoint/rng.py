"""Capture and restore this process's random number generators (python, numpy, torch, CUDA).

Example::

    saved = capture_rng()
    ...
    restore_rng(saved)     # the next random draws repeat
"""

from __future__ import annotations

import random

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None


def capture_rng() -> dict:
    """The states of every generator present, in a form ``torch.load(weights_only=True)`` reads."""
    state = host_rng_form(host_rng())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def host_rng() -> tuple:
    """python's, numpy's and torch's CPU generator states as their getters return them: cheap
    enough to take before every batch a dataloader reads (checkpoint/dataloader.py)."""
    return random.getstate(), (np.random.get_state() if np is not None else None), torch.get_rng_state()


def host_rng_form(raw: tuple) -> dict:
    """What :func:`host_rng` returned, in :func:`capture_rng`'s form (``restore_rng`` reads it)."""
    python, numpy_state, torch_state = raw
    state = {"python": _to_lists(python), "torch": torch_state}
    if numpy_state is not None:
        kind, keys, pos, has_gauss, cached = numpy_state
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def restore_rng(state: dict) -> None:
    """Restore what :func:`capture_rng` returned (generators missing on either side are left)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) != torch.cuda.device_count():
            raise ValueError(
                f"the checkpoint holds CUDA RNG states for {len(states)} device(s) but this process "
                f"sees {torch.cuda.device_count()}; set CUDA_VISIBLE_DEVICES as when it was saved"
            )
        torch.cuda.set_rng_state_all(states)


def _to_lists(obj):
    if isinstance(obj, tuple):
        return [_to_lists(x) for x in obj]
    return obj
