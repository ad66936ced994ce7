"""Process helpers: who this process is (``process_index``, ``is_main_process``...), barriers
(``wait_for_everyone``, ``main_process_first``), the collectives a loop calls on its own
tensors (``gather``, ``gather_for_metrics``, ``reduce``, ``pad_across_processes``) and
``join_uneven_inputs`` (mixprec/join.py). The collectives are distributed/collectives.py's
over the Accelerator's state; each is checked by the desync watchdog
(distributed/watchdog.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ..distributed import collectives
from ..distributed import watchdog as desync
from ..join import join_uneven_inputs
from ..utils import tree_map_tensors

# main_process_first's barrier, checked under its own name: the main process may be inside
# the block far longer than collective_timeout, which its peers' check allows.
_first_barrier = desync.tracked("main_process_first", desync.plain_signature)(collectives.barrier)


class Processes:
    """Mixin of :class:`mixprec.Accelerator` (reads ``state``, ``mesh`` and
    ``gradient_state``)."""

    @property
    def num_processes(self) -> int:
        return self.state.world_size

    @property
    def process_index(self) -> int:
        return self.state.rank

    @property
    def local_process_index(self) -> int:
        return self.state.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier across all processes."""
        collectives.barrier(self.state)

    @contextlib.contextmanager
    def main_process_first(self):
        """Run the block on the main process first, then on the others (e.g. a download)."""
        if not self.is_main_process:
            _first_barrier(self.state)
        with desync.long_body() if self.is_main_process else contextlib.nullcontext():
            yield
        if self.is_main_process:
            _first_barrier(self.state)

    @contextlib.contextmanager
    def local_main_process_first(self):
        """Like :meth:`main_process_first`, per node."""
        if not self.is_local_main_process:
            _first_barrier(self.state)
        with desync.long_body() if self.is_local_main_process else contextlib.nullcontext():
            yield
        if self.is_local_main_process:
            _first_barrier(self.state)

    def join_uneven_inputs(self, joinables, even_batches: Optional[bool] = None):
        """Context manager for loops where ranks get different numbers of batches (Accelerate's
        semantics): a rank whose data ran out leaves the block and shadows the forwards,
        backwards and optimizer steps the other ranks still run on ``joinables`` (prepared
        models and optimizers), on every backend, so their collectives complete
        ([Note: shadowing by announcement] in mixprec/join.py). ``even_batches`` overrides
        the prepared map-style dataloaders' setting inside the block (an iterable one keeps
        its own, with a warning). With even batches in effect it does nothing.

        Example::

            with accelerator.join_uneven_inputs([model, optimizer], even_batches=False):
                for x, y in loader:
                    accelerator.backward(loss_fn(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
        """
        return join_uneven_inputs(self, joinables, even_batches)

    def gather(self, tensor):
        """All-gather tensors (nested containers too), concatenated on dim 0."""
        return collectives.gather(self.state, tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """``gather``, dropping the samples even-batching duplicated at the end of an epoch;
        under tensor/sequence parallelism each sample once, from one rank per data-parallel
        rank ([Note: metrics over data-parallel ranks] in distributed/collectives.py)."""
        ranks = self._data_ranks()
        if use_gather_object or not _has_tensor(input_data):
            gathered = collectives.gather_object(self.state, input_data, ranks)
            flat = [x for part in gathered for x in (part if isinstance(part, list) else [part])]
            remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else None
            return flat[:remainder] if remainder else flat
        remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else None
        return collectives.gather_for_metrics(self.state, input_data, remainder, ranks)

    def _data_ranks(self) -> Optional[tuple]:
        """The ranks at this rank's (sp, tp) place of the mesh, one per data-parallel rank in
        order (``rank = (d * sp + s) * tp + t``, parallel/mesh.py); None without a mesh."""
        m = self.mesh
        if m is None:
            return None
        return tuple((d * m.sp_size + m.sp_rank) * m.tp_size + m.tp_rank for d in range(m.dp_size))

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """Reduce tensors across processes (``"sum"``, ``"mean"``, ``"max"``, ``"min"``), then
        multiply by ``scale``; returns new tensors."""
        out = collectives.reduce(self.state, tensor, reduction)
        if scale != 1.0:
            out = tree_map_tensors(lambda t: t * scale, out)
        return out

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        """Pad tensors on ``dim`` to the largest size over processes, so they can be gathered."""
        return collectives.pad_across_processes(self.state, tensor, dim, pad_index, pad_first)

    def split_between_processes(self, inputs, apply_padding: bool = False):
        """Context manager giving this process its share of ``inputs``."""
        return collectives.split_between_processes(self.state, inputs, apply_padding)


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(x) for x in obj)
    if isinstance(obj, dict):
        return any(_has_tensor(x) for x in obj.values())
    return False
