"""What an Accelerator saves and restores: the glue between it, its engine and the format.

``save_accelerator_state`` asks the engine for its shards (the only backend-specific part),
collects the backend-independent state (optimizer hyper-parameters and counters, scaler,
schedulers, accumulation position, registered objects; per rank: RNG states and dataloader
positions) and writes them with :func:`.writer.write_checkpoint`.
``load_accelerator_state`` verifies the checkpoint and validates EVERYTHING against the
prepared objects before the first copy, so a mismatch loads nothing.

Example::

    save_accelerator_state(accelerator, Path("ckpt"))
    load_accelerator_state(accelerator, Path("ckpt"))
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..distributed import collectives
from ..step import StepResult
from . import format as fmt
from .dataloader import ResumableDataLoader
from .format import CheckpointError
from .reader import CheckpointReader
from .rng import capture_rng, restore_rng
from .writer import write_checkpoint

logger = logging.getLogger("mixprec")


def _raw_optimizers(acc) -> list:
    return [o.optimizer for o in acc._optimizers]


def save_accelerator_state(acc, target: Path, custom: list) -> Path:
    """Collective: write everything ``acc`` prepared (and ``custom`` objects) to ``target``."""
    import mixprec

    for i, dl in enumerate(acc._dataloaders):
        if not isinstance(dl, ResumableDataLoader) and acc.gradient_state.active_dataloaders:
            raise ValueError(
                f"save_state() was called while iterating, but prepared dataloader {i} does not track "
                "its position; call mixprec.checkpoint.make_resumable(loader) right after prepare()"
            )
    shards = acc.engine.state_shards(acc._models, _raw_optimizers(acc))
    objects = None
    if acc.state.rank == 0:
        objects = {
            "optimizers": [
                {
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
                    "group_sizes": [len(g["params"]) for g in o.param_groups],
                    "skipped": o._state.skipped,
                    "last": None if o._state.last is None else dataclasses.asdict(o._state.last),
                }
                for o in acc._optimizers
            ],
            "scaler": acc.engine.scaler_state_dict(),
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "gradient_state": {"step": acc.gradient_state.step, "sync_gradients": acc.gradient_state.sync_gradients},
            "custom": [obj.state_dict() for obj in custom],
            "num_models": len(acc._models),
            "num_dataloaders": len(acc._dataloaders),
        }
    rank_state = {
        "rng": capture_rng(),
        "dataloaders": [dl.checkpoint_state() if isinstance(dl, ResumableDataLoader) else None for dl in acc._dataloaders],
    }
    meta = {
        "mixprec_version": mixprec.__version__,
        "torch_version": torch.__version__,
        "backend": acc.engine.name,
        "world_size": acc.state.world_size,
        "policy": {"name": acc.policy.name, "repr": repr(acc.policy)},
        "iteration": acc.project_configuration.iteration,
    }
    return write_checkpoint(acc.state, target, shards, rank_state, objects, meta)


def load_accelerator_state(acc, source: Path, custom: list) -> CheckpointReader:
    """Collective: verify ``source``, validate it against ``acc``, then restore everything."""
    outcome = None
    try:
        reader = CheckpointReader(source)
        objects = reader.objects()
        _validate(acc, reader, objects, custom)
    except (CheckpointError, ValueError, OSError) as e:
        outcome = f"{type(e).__name__}: {e}"
    outcomes = collectives.gather_object(acc.state, outcome)
    errors = [f"rank {r}: {o}" for r, o in enumerate(outcomes) if o is not None]
    if errors:
        raise CheckpointError(f"load_state({str(source)!r}) loaded nothing: " + "; ".join(dict.fromkeys(errors)))
    acc.engine.load_state_shards(acc._models, _raw_optimizers(acc), reader)
    for opt, saved in zip(acc._optimizers, objects["optimizers"]):
        for group, hyper in zip(opt.param_groups, saved["param_groups"]):
            group.update(hyper)
        opt._state.skipped = saved["skipped"]
        opt._state.last = None if saved["last"] is None else StepResult(**saved["last"])
    if objects["scaler"] or acc.engine.scaler is not None:
        if objects["scaler"]:
            acc.engine.load_scaler_state_dict(objects["scaler"])
        else:
            logger.warning("mixprec: %s holds no loss-scaler state; the scaler starts fresh", source)
    for sched, sd in zip(acc._schedulers, objects["schedulers"]):
        sched.load_state_dict(sd)
    acc.gradient_state.step = objects["gradient_state"]["step"]
    acc.gradient_state.sync_gradients = objects["gradient_state"]["sync_gradients"]
    for obj, sd in zip(custom, objects["custom"]):
        obj.load_state_dict(sd)
    mine = reader.rank_state(acc.state.rank)
    if mine is None:
        logger.warning(
            "mixprec: %s was saved by %d process(es); rank %d keeps its RNG state",
            source, reader.world_size, acc.state.rank,
        )
        mine = reader.rank_state(0)
    for i, (dl, saved) in enumerate(zip(acc._dataloaders, mine["dataloaders"])):
        if saved is not None:
            ResumableDataLoader.load_checkpoint_state(_resumable(dl), saved, i)
    if reader.rank_state(acc.state.rank) is not None:
        restore_rng(mine["rng"])
    return reader


def _resumable(dl):
    from .dataloader import make_resumable

    return make_resumable(dl)


def _validate(acc, reader: CheckpointReader, objects: dict, custom: list) -> None:
    """Raise listing every mismatch between the checkpoint and what ``acc`` prepared."""
    expected = acc.engine.state_names(acc._models)
    saved = {n: shape for n, (shape, _) in reader.index.items() if not n.startswith(fmt.OPTIM_PREFIX)}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    misshaped = sorted(f"{n}: checkpoint {saved[n]} vs model {expected[n]}" for n in set(saved) & set(expected) if saved[n] != expected[n])
    param_keys = {n[len("model/"):] if n.startswith("model/") else n for n in expected}
    problems = []
    for n in reader.names(fmt.OPTIM_PREFIX):
        _, j, rest = n.split("/", 2)
        key = rest.rsplit("/", 1)[0]
        if int(j) >= len(acc._optimizers):
            problems.append(f"optimizer state {n!r} for optimizer {j}, but {len(acc._optimizers)} optimizer(s) were prepared")
        elif key not in param_keys:
            unexpected.append(n)
    if missing or unexpected or misshaped:
        raise CheckpointError(
            f"checkpoint {str(reader.path)!r} does not match the prepared model(s): missing keys {missing}, "
            f"unexpected keys {unexpected}, mis-shaped keys {misshaped}. Build the same model as when "
            "saving (renamed layers change keys)"
        )
    counts = [
        ("models", objects["num_models"], len(acc._models)),
        ("optimizers", len(objects["optimizers"]), len(acc._optimizers)),
        ("schedulers", len(objects["schedulers"]), len(acc._schedulers)),
        ("dataloaders", objects["num_dataloaders"], len(acc._dataloaders)),
        ("objects registered for checkpointing", len(objects["custom"]), len(custom)),
    ]
    for what, theirs, ours in counts:
        if theirs != ours:
            problems.append(f"the checkpoint holds {theirs} {what} but {ours} were prepared/registered")
    for j, (opt, saved_opt) in enumerate(zip(acc._optimizers, objects["optimizers"])):
        # Group count, not group sizes: a sharded engine's groups hold shard segments, so sizes
        # differ between backends while the groups (and the names of their state) match.
        groups = len(opt.param_groups)
        if groups != len(saved_opt["group_sizes"]):
            problems.append(f"optimizer {j} has {groups} param group(s), the checkpoint {len(saved_opt['group_sizes'])}")
    if objects["scaler"] and acc.engine.scaler is None:
        problems.append(
            f"the checkpoint holds loss-scaler state but mixed_precision={acc.policy.name!r} has no loss "
            "scaling; load it with mixed_precision='fp16'"
        )
    if problems:
        raise CheckpointError(f"checkpoint {str(reader.path)!r} does not match: " + "; ".join(problems) + ". Prepare the same objects, in the same order, as when saving")
