"""Data loaders: ``prepare_data_loader`` and the dataloader settings (Accelerate's
``DataLoaderConfiguration``).

A prepared loader is one of three: dispatched (rank 0 reads, the others receive: [Note:
dispatching batches] in data/dispatch.py), sharded over the data-parallel ranks
(data/sharding.py; under tensor/sequence parallelism the ranks of a TP/SP group read the
same batches), or the user's own loader re-made with a seeded order or a StatefulDataLoader's
samplers. Every prepared loader is resumable (checkpoint/dataloader.py): ``save_state``
records the position in the pass and ``load_state`` resumes there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..checkpoint.dataloader import ResumableDataLoader, StatefulPreparedDataLoader
from ..data.sharding import _KEPT, shard_dataloader
from ..distributed.state import DistributedState
from ..wrappers.dataloader import PreparedDataLoader


class Loaders:
    """Mixin of :class:`mixprec.Accelerator`: the dataloader settings (``split_batches``,
    ``even_batches``, ``data_seed``, ``use_seedable_sampler``, ``non_blocking``,
    ``dispatch_batches``, ``use_stateful_dataloader``, ``device_placement``) and the
    prepared loaders (``_dataloaders``)."""

    def _start_loaders(self, cfg: Any, compat: Any, device_placement: bool) -> None:
        """The settings from the resolved config and Accelerate's options."""
        self.split_batches = cfg.split_batches
        self.even_batches = cfg.even_batches
        self.data_seed = cfg.data_seed
        self.use_seedable_sampler = compat.use_seedable_sampler
        self.dispatch_batches = compat.dispatch_batches
        self.use_stateful_dataloader = compat.use_stateful_dataloader
        if self.use_stateful_dataloader:
            stateful_loader_class()  # without torchdata: the ImportError naming the fix, now
        self.non_blocking = compat.non_blocking
        self.device_placement = bool(device_placement)

    @property
    def dataloader_config(self):
        """The dataloader settings in effect, as a ``DataLoaderConfiguration``. Assigning one
        (mixprec's or Accelerate's) changes how dataloaders prepared from then on are served,
        as in Accelerate; those prepared before keep theirs."""
        from ..compat.options import DataLoaderConfiguration

        return DataLoaderConfiguration(split_batches=self.split_batches, even_batches=self.even_batches,
                                       use_seedable_sampler=self.use_seedable_sampler, data_seed=self.data_seed,
                                       non_blocking=self.non_blocking, dispatch_batches=self.dispatch_batches,
                                       use_stateful_dataloader=self.use_stateful_dataloader)

    @dataloader_config.setter
    def dataloader_config(self, value) -> None:
        from ..compat.options import DataLoaderConfiguration, read_fields

        dl = read_fields(value, DataLoaderConfiguration, "dataloader_config")
        self.split_batches, self.even_batches = bool(dl.split_batches), bool(dl.even_batches)
        self.use_seedable_sampler, self.data_seed = bool(dl.use_seedable_sampler), dl.data_seed
        self.non_blocking, self.dispatch_batches = bool(dl.non_blocking), dl.dispatch_batches
        self.use_stateful_dataloader = bool(dl.use_stateful_dataloader)
        if self.use_stateful_dataloader:
            stateful_loader_class()

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader,
                            device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Optional[Callable] = None) -> PreparedDataLoader:
        """Prepare one dataloader (``prepare()`` calls this for each). ``device_placement``:
        whether batches are moved to ``accelerator.device`` (None: the Accelerator's
        ``device_placement``). ``slice_fn_for_dispatch``: under ``dispatch_batches``, how rank 0
        cuts each batch into the ranks' pieces, Accelerate's signature
        ``fn(batch, slice(lo, hi), process_index=r, num_processes=n)`` returning rank ``r``'s
        piece (default: tensors and per-sample lists sliced ``[lo:hi]``); unused when the
        loader is sharded instead, as in Accelerate."""
        self._check_not_reset()
        if slice_fn_for_dispatch is not None and not callable(slice_fn_for_dispatch):
            raise TypeError(f"prepare_data_loader(slice_fn_for_dispatch={slice_fn_for_dispatch!r}) needs a callable "
                            f"fn(batch, slice, process_index=, num_processes=)")
        dataloader = data_loader
        if isinstance(dataloader, PreparedDataLoader):
            if dataloader in self._dataloaders:
                return dataloader  # preparing twice gives the same loader
            dataloader = dataloader.original  # another Accelerator's: shard the user's loader anew
        original = dataloader
        loader_cls = stateful_loader_class() if self.use_stateful_dataloader else torch.utils.data.DataLoader
        if self._dispatches(dataloader) and self.state.world_size > 1:
            dataloader = self._dispatched(dataloader, loader_cls, slice_fn_for_dispatch)
        else:
            dataloader = self._sharded(dataloader, loader_cls)
        place = self.device_placement if device_placement is None else device_placement
        # Resumable: save_state records the position in the pass, load_state skips ahead
        # (or, with use_stateful_dataloader, restores the StatefulDataLoader's own state).
        kind = StatefulPreparedDataLoader if self.use_stateful_dataloader else ResumableDataLoader
        prepared = kind(dataloader, self.device if place else None, self.gradient_state,
                        original=original, non_blocking=self.non_blocking)
        sp = self.config.config.sequence_parallel
        if sp.prepare_batches:
            prepared.batch_transform = lambda batch, seq_dim=sp.seq_dim: self._sp_batch(batch, seq_dim)
        self._dataloaders.append(prepared)
        return prepared

    def _dispatches(self, dataloader: torch.utils.data.DataLoader) -> bool:
        """Whether rank 0 reads ``dataloader`` for everyone (``dispatch_batches``; None:
        Accelerate's default, True for a stream, an IterableDataset)."""
        dispatch = self.dispatch_batches
        if dispatch is None:
            dispatch = isinstance(dataloader.dataset, torch.utils.data.IterableDataset) and self.mesh is None
        if dispatch and self.mesh is not None:
            raise ValueError(
                "dataloader_config.dispatch_batches=True is not supported under tensor or sequence parallelism (the "
                "ranks of a TP/SP group read the same batches); use dispatch_batches=False"
            )
        return dispatch

    def _dispatched(self, dataloader: torch.utils.data.DataLoader, loader_cls: type,
                    slice_fn: Optional[Callable] = None):
        from ..data.dispatch import DispatchedLoader

        if self._dispatch_group is None:  # its own group: [Note: dispatching batches]
            self._dispatch_group = torch.distributed.new_group(backend="gloo")
        if self.use_stateful_dataloader:  # rank 0 reads a StatefulDataLoader
            dataloader = _as_stateful(dataloader, loader_cls)
        return DispatchedLoader(dataloader, rank=self.state.rank, world_size=self.state.world_size,
                                group=self._dispatch_group, split_batches=self.split_batches,
                                even_batches=self.even_batches, slice_fn=slice_fn)

    def _sharded(self, dataloader: torch.utils.data.DataLoader, loader_cls: type):
        """The loader over this rank's share (one process: the user's loader, re-made only for
        a seeded order or a StatefulDataLoader's samplers)."""
        # data_seed / use_seedable_sampler concern plain shuffling loaders only.
        plain_shuffle = (type(dataloader.sampler) is torch.utils.data.RandomSampler
                         and not dataloader.sampler.replacement
                         and dataloader.sampler.num_samples == len(dataloader.dataset))
        seed = self.data_seed if plain_shuffle else None
        if self.state.world_size > 1:
            # Under tensor or sequence parallelism the ranks of a TP/SP group read the same
            # batches: the loader shards over the data-parallel ranks only.
            mesh = self.mesh
            return shard_dataloader(
                dataloader, self.state, split_batches=self.split_batches,
                even_batches=self.even_batches, seed=seed,
                use_seedable_sampler=self.use_seedable_sampler,
                shard=None if mesh is None else (mesh.dp_rank, mesh.dp_size), loader_cls=loader_cls,
            )
        seeded = plain_shuffle and (self.use_seedable_sampler or seed is not None)
        if seeded or self.use_stateful_dataloader:
            # One process: the same seeded order (seed + epoch) several processes would share;
            # or the samplers that keep a StatefulDataLoader's position (data/sharding.py).
            return shard_dataloader(dataloader, self.state, seed=seed,
                                    use_seedable_sampler=self.use_seedable_sampler, loader_cls=loader_cls)
        return dataloader


def stateful_loader_class() -> type:
    """torchdata's StatefulDataLoader, for ``use_stateful_dataloader=True``."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError as e:
        raise ImportError(
            f"dataloader_config.use_stateful_dataloader=True needs torchdata's StatefulDataLoader, which is not "
            f"importable here ({e}); install it (`pip install torchdata`), or drop the option: prepared "
            f"dataloaders resume mid-epoch through save_state/load_state without it (docs/checkpointing.md)"
        ) from None
    return StatefulDataLoader


def _as_stateful(loader: torch.utils.data.DataLoader, loader_cls: type) -> torch.utils.data.DataLoader:
    """The same loader as a StatefulDataLoader (for rank 0 of a dispatched one)."""
    if not isinstance(loader.dataset, torch.utils.data.IterableDataset):
        one = DistributedState()  # one process: no communication, the loader's own order
        return shard_dataloader(loader, one, loader_cls=loader_cls)
    kept = {k: getattr(loader, k) for k in _KEPT if hasattr(loader, k)}
    if loader.num_workers > 0:
        kept["prefetch_factor"] = loader.prefetch_factor
    else:
        kept.pop("persistent_workers", None)
    return loader_cls(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kept)
