"""Dataloader positions that survive a restart: count the batches handed out, skip them on resume.

``make_resumable(loader)`` turns a prepared dataloader into a :class:`ResumableDataLoader`
(the same object; its class gains a counter). ``save_state`` records, per dataloader, how
many batches of the current pass were handed out, the RNG state that drew the pass's
order, and the sharded sampler's epoch and shuffle seed. ``load_state`` arms the next
``iter()`` to draw the same order and skip the consumed batches (``skip_first_batches``
semantics), so the loop continues with the batch that came next.

Skipped batches are still loaded (and dropped): datasets whose ``__getitem__`` draws
random numbers see them in a different order than in an uninterrupted run. A collate_fn (or
``__getitem__``) drawing from the process's generators in the main process is repeated
exactly for the batches after the checkpoint ([Note: the batch read ahead]).

[Note: the batch read ahead]
The prepared loader reads one batch ahead (to mark the last one), so when the loop holds
batch k and calls ``save_state``, batch k+1 was already read: its collate_fn drew its random
numbers (transformers' DataCollatorForLanguageModeling masks with torch's global RNG) from
the states before that read, and the RNG states ``save_state`` records are later ones (after
that read and the loop's own draws, dropout included), the states batch k+2's read starts
from. Resuming from them alone, batch k+1 is read again from the wrong states (issue #48
point 3: run_mlm_no_trainer resumed to another perplexity). So every read first takes the
python, numpy and torch CPU generator states and the loader's own generators
(``_mixprec_read_rng``, cheap getters), ``checkpoint_state`` records those of read k+1
(``read_rng``), and the resumed pass, whose reads all happen before it yields its first
batch, reads batch k+1 from them and then puts back the states it started with (the
checkpoint's, restored by ``load_state``) for batch k+2 and the loop. Only when the resumed
pass continues at batch k+1 of the same layout (``skip_first_batches(loader, k)`` or the
positioned resume, same global batch size); CUDA generators are not taken (collate_fns run
on the host). Worker processes (``num_workers > 0``) draw from their own generators, seeded
from the pass's order states and advanced by the skipped batches, which are read as before.
A StatefulDataLoader's resume and a dispatched loader (``dispatch_batches``, read ahead in
a thread) do not replay the read.

Example::

    loader = accelerator.prepare(DataLoader(ds, batch_size=8, shuffle=True))
    make_resumable(loader)               # right after prepare(), before iterating
    accelerator.load_state(ckpt)         # the next `for batch in loader` resumes mid-epoch
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..wrappers.dataloader import PreparedDataLoader
from .rng import capture_rng, host_rng, host_rng_form, restore_rng

_END = object()


class ResumableDataLoader(PreparedDataLoader):
    """A :class:`PreparedDataLoader` that knows its position in the current pass."""

    _mixprec_yielded = 0  # batches handed out in the current pass (skipped ones included)
    _mixprec_in_progress = False  # a pass started and has not run to its end
    _mixprec_epoch_rng: Optional[dict] = None  # generator states that drew this pass's order
    _mixprec_skip = 0  # batches the next pass skips (set by load_state)
    _mixprec_order_rng: Optional[dict] = None  # generator states the next pass draws from
    # (read number in the pass, host_rng(), loader generator states) before the latest read
    _mixprec_read_rng: Optional[tuple] = None
    _mixprec_replay: Optional[tuple] = None  # (read number, saved states) the next pass reads from
    _mixprec_replay_now: Optional[tuple] = None  # the same, with the states to put back, for _batches

    def __iter__(self):
        return self._mixprec_pass(None)

    def _mixprec_pass(self, skip_first: Optional[int]):
        """One pass; ``skip_first`` (from ``skip_first_batches``) replaces the number of
        batches to skip. A position armed by ``load_state`` is consumed either way: its order
        is the pass's order, so ``load_state`` + ``skip_first_batches(loader, n)`` (the
        Accelerate idiom) continues the checkpointed pass after batch ``n``, and the next pass
        draws the next order, as in the uninterrupted run."""
        skip, order_rng, replay = self._mixprec_skip, self._mixprec_order_rng, self._mixprec_replay
        self._mixprec_skip, self._mixprec_order_rng, self._mixprec_replay = 0, None, None
        if skip_first is not None:
            if order_rng is not None and skip_first != skip:
                warnings.warn(
                    f"skip_first_batches(loader, {skip_first}) after load_state(), whose checkpoint was saved "
                    f"after batch {skip} of this pass: skipping {skip_first} batches as asked (the pass's order "
                    f"is the checkpoint's). Pass {skip} to continue exactly where the checkpoint left off, or "
                    f"iterate the loader itself (load_state already positioned it)",
                    stacklevel=3,
                )
            skip = skip_first
        self._mixprec_epoch_rng = order_rng if order_rng is not None else self._rng_states()
        self._mixprec_yielded = 0
        self._mixprec_in_progress = True
        self._mixprec_read_rng = None
        gen = super().__iter__()
        try:
            if replay is not None and replay[0] == skip + 1:
                # [Note: the batch read ahead]: batch skip+1 is read from the states before its
                # read in the checkpointed run; the states now (the checkpoint's) come back after.
                self._mixprec_replay_now = (*replay, (capture_rng(), self._generator_states()))
            first = _END
            if order_rng is not None:
                # The pass's order is drawn when iteration starts: draw it from the saved
                # states, then give the generators back the checkpoint's current states.
                now = self._rng_states()
                self._set_rng_states(order_rng)
                try:
                    first = next(gen, _END)
                finally:
                    self._set_rng_states(now)
                if first is _END:
                    self._mixprec_in_progress = False
                    return
            count = 0
            while True:
                batch, first = (first, _END) if first is not _END else (next(gen, _END), _END)
                if batch is _END:
                    break
                count += 1
                if count <= skip:
                    continue
                self._mixprec_yielded = count
                yield batch
            self._mixprec_yielded = count
            self._mixprec_in_progress = False
        finally:
            self._mixprec_replay_now = None
            gen.close()

    def _batches(self):
        inner = self.dataloader
        from ..data.dispatch import DispatchedLoader

        if isinstance(inner, DispatchedLoader):  # read ahead in a thread: nothing to take per read
            return iter(inner)
        return self._reads(iter(inner))

    def _reads(self, it):
        """The wrapped loader's batches, each read after taking the generator states it starts
        from; the read a resumed pass replays starts from the checkpoint's ([Note: the batch
        read ahead])."""
        replay, self._mixprec_replay_now = self._mixprec_replay_now, None
        number = 0
        while True:
            number += 1
            again = replay is not None and number == replay[0]
            if again:
                saved, (host_now, generators_now) = replay[1], replay[2]
                restore_rng(saved["host"])
                self._set_generator_states(saved["generators"])
            self._mixprec_read_rng = (number, host_rng(), self._generator_states())
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                if again:
                    restore_rng(host_now)
                    self._set_generator_states(generators_now)
            yield batch

    def _generator_states(self) -> dict:
        return {k: g.get_state() for k, g in self._generators().items()}

    def _set_generator_states(self, states: dict) -> None:
        for k, g in self._generators().items():
            if k in states:
                g.set_state(states[k])

    def _generators(self) -> dict:
        found = {}
        for where, obj in (("loader", self.dataloader), ("sampler", getattr(self.dataloader, "sampler", None))):
            g = getattr(obj, "generator", None)
            if isinstance(g, torch.Generator):
                found[where] = g
        # The generator a sharded loader's sampler draws from (shard_dataloader may give a
        # RandomSampler one of its own; see mixprec/data/sharding.py).
        from ..data.sharding import find_generators

        nested = find_generators(getattr(self.dataloader, "batch_sampler", None)) + find_generators(
            getattr(self.dataloader, "sampler", None))
        for i, g in enumerate(nested):
            if all(g is not x for x in found.values()):
                found[f"nested{i}"] = g
        return found

    def _rng_states(self) -> dict:
        states = {"torch": torch.get_rng_state()}
        states.update({k: g.get_state() for k, g in self._generators().items()})
        return states

    def _set_rng_states(self, states: dict) -> None:
        torch.set_rng_state(states["torch"])
        for k, g in self._generators().items():
            if k in states:
                g.set_state(states[k])

    def total_batch_size(self) -> int:
        """Samples one batch stands for across all processes (to translate positions)."""
        for obj in (getattr(self.dataloader, "batch_sampler", None), getattr(self.dataloader, "dataset", None),
                    self.dataloader):
            value = getattr(obj, "total_batch_size", None)
            if isinstance(value, int):
                return value
        return self.dataloader.batch_size or 1

    def checkpoint_state(self) -> dict:
        sampler = getattr(self.dataloader, "batch_sampler", None)
        return {
            "yielded": self._mixprec_yielded if self._mixprec_in_progress else 0,
            "in_progress": self._mixprec_in_progress,
            "total_batch_size": self.total_batch_size(),
            "epoch_rng": self._mixprec_epoch_rng if self._mixprec_in_progress else None,
            "sampler_epoch": getattr(sampler, "epoch", None),
            "shuffle_seed": getattr(sampler, "shuffle_seed", None),
            # Where the loader's generators are now (after drawing this pass's order): a
            # resumed run continues from here, so the next pass draws the next order.
            "generators_now": {k: g.get_state() for k, g in self._generators().items()},
            # The states batch yielded+1 (read ahead) was read from ([Note: the batch read ahead]).
            "read_rng": self._read_rng_to_save(),
        }

    def _read_rng_to_save(self) -> Optional[dict]:
        read = self._mixprec_read_rng
        if not self._mixprec_in_progress or read is None or read[0] != self._mixprec_yielded + 1:
            return None
        return {"host": host_rng_form(read[1]), "generators": read[2]}

    def load_checkpoint_state(self, state: dict, index: int) -> None:
        samples = state["yielded"] * state["total_batch_size"]
        mine = self.total_batch_size()
        if samples % mine:
            raise ValueError(
                f"dataloader {index}: the checkpoint consumed {state['yielded']} batches of "
                f"{state['total_batch_size']} samples ({samples}), which is not a whole number of this "
                f"run's global batches of {mine}; use a global batch size that divides {samples}"
            )
        sampler = getattr(self.dataloader, "batch_sampler", None)
        if state["sampler_epoch"] is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(state["sampler_epoch"])
        if state["shuffle_seed"] is not None and getattr(sampler, "shuffle_seed", None) is not None:
            sampler.shuffle_seed = state["shuffle_seed"]
        generators = self._generators()
        for key, value in (state.get("generators_now") or {}).items():
            if key in generators:
                generators[key].set_state(value)
        self._mixprec_skip = samples // mine
        self._mixprec_order_rng = state["epoch_rng"] if state["in_progress"] else None
        read_rng = state.get("read_rng")  # absent from checkpoints saved before it was recorded
        # Replayed only where the resumed pass continues at the same batch (same global batch size).
        same_batch = self._mixprec_skip == state["yielded"]
        self._mixprec_replay = (state["yielded"] + 1, read_rng) if (
            state["in_progress"] and read_rng is not None and same_batch) else None
        self._mixprec_in_progress = False


class StatefulPreparedDataLoader(ResumableDataLoader):
    """``use_stateful_dataloader=True``: the wrapped loader is torchdata's
    ``StatefulDataLoader`` (or, under ``dispatch_batches``, a DispatchedLoader reading one on
    rank 0), whose samplers and dataset keep their own position (mixprec/data/sharding.py's
    ``_ResumablePass``; a dataset with ``state_dict``, e.g. a streaming Hugging Face dataset).

    ``state_dict()`` is the wrapped loader's state *after the batch the loop holds*: the
    prepared loader reads one batch ahead (to mark the last one), so the state is taken
    before each read, not after. ``load_state_dict()`` makes the next pass continue with the
    next batch, without loading the skipped ones. ``save_state``/``load_state`` store it
    with the other dataloader positions.
    """

    _mixprec_before_read: Optional[dict] = None  # the wrapped loader's state before its latest read

    def _batches(self):
        inner = self.dataloader
        it = iter(inner)

        def reads():
            while True:
                self._mixprec_before_read = inner.state_dict()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                yield batch

        return reads()

    _mixprec_resume_pending = False  # load_state_dict() gave a position the next pass starts from

    def _mixprec_pass(self, skip_first: Optional[int]):
        # Every pass, the loader's own or a skip_first_batches one, consumes a loaded state.
        self._mixprec_before_read = None
        self._mixprec_resume_pending = False
        return super()._mixprec_pass(skip_first)

    def state_dict(self) -> Optional[dict]:
        if self._mixprec_in_progress and self._mixprec_before_read is not None:
            return self._mixprec_before_read
        return self.dataloader.state_dict()

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.dataloader.load_state_dict(state)
        self._mixprec_resume_pending = state is not None
        self._mixprec_before_read = None
        self._mixprec_skip, self._mixprec_order_rng, self._mixprec_in_progress = 0, None, False
        self._mixprec_replay = None

    def _layout(self) -> tuple:
        """(processes the loader is sharded over, global batch size): what a state needs."""
        inner = self.dataloader
        world = getattr(getattr(inner, "batch_sampler", None), "world_size", getattr(inner, "world_size", 1))
        return int(world), self.total_batch_size()

    def checkpoint_state(self) -> dict:
        out = super().checkpoint_state()
        out["stateful"] = self.state_dict()
        out["stateful_layout"] = self._layout()
        return out

    def load_checkpoint_state(self, state: dict, index: int) -> None:
        self.check_stateful(state, index)
        self.load_state_dict(state["stateful"])

    def check_stateful(self, state: dict, index: int) -> None:
        """Raise a ValueError when ``state`` cannot be resumed here (load_state's phase 1)."""
        if "stateful" not in state:
            raise ValueError(
                f"dataloader {index}: the checkpoint has no StatefulDataLoader state (it was saved without "
                f"use_stateful_dataloader=True); load it with the same dataloader_config"
            )
        saved, mine = tuple(state.get("stateful_layout", ())), self._layout()
        if saved and saved != mine:
            raise ValueError(
                f"dataloader {index}: its StatefulDataLoader state was saved sharded over {saved[0]} process(es) "
                f"with a global batch of {saved[1]}; this run has {mine[0]} and {mine[1]}. Resume with the same "
                f"layout, or without use_stateful_dataloader (positions are then translated through samples)"
            )


def make_resumable(loader: PreparedDataLoader) -> ResumableDataLoader:
    """Give a prepared dataloader a position that ``save_state`` records (idempotent).

    Call it right after ``prepare()``, before the first pass, so every batch is counted.
    """
    if isinstance(loader, ResumableDataLoader):
        return loader
    if type(loader) is not PreparedDataLoader:
        raise TypeError(
            f"make_resumable() needs a dataloader returned by accelerator.prepare(), got "
            f"{type(loader).__name__}; pass the prepared loader"
        )
    loader.__class__ = ResumableDataLoader
    return loader
