"""What an Accelerator saves and restores: the glue between it, its engine and the format.

``save_accelerator_state`` asks the engine for its shards (the only backend-specific part),
collects the backend-independent state (optimizer hyper-parameters and counters, scaler,
schedulers, accumulation position, registered objects; per rank: RNG states and dataloader
positions) and writes them with :func:`.writer.write_checkpoint`.
``load_accelerator_state`` verifies the checkpoint and validates EVERYTHING against the
prepared objects before the first copy, so a mismatch loads nothing.

[Note: two-phase load] Phase 1, on every rank: open the checkpoint (integrity and
well-formedness, see [Note: well-formed] in reader.py), unpickle ``objects.pt`` and this
rank's ``rank<r>.pt``, and compare everything this rank will read with what it prepared:
tensor names, shapes and dtypes, optimizer class, hyper-parameter names and state keys,
counts of prepared objects, dataloader positions. Any exception is caught and becomes
text. Then ONE all-gather of "ok or error text" (the only collective before any tensor is
touched): if any rank failed, every rank raises the same CheckpointError listing each
rank's problem, and nothing was changed anywhere. Only then phase 2 copies. A rank that
raised alone (as before this check) would leave the others inside the engine's load,
whose parameter all-gather would wait for it forever.

Example::

    save_accelerator_state(accelerator, Path("ckpt"))
    load_accelerator_state(accelerator, Path("ckpt"))
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..distributed import collectives
from ..step import StepResult
from . import format as fmt
from .accelerate_folder import AccelerateFolder, is_accelerate_folder
from .dataloader import ResumableDataLoader, StatefulPreparedDataLoader
from .format import CheckpointError
from .reader import CheckpointReader
from .writer import restore_moved_aside
from .rng import capture_rng, restore_rng
from .writer import write_checkpoint

logger = logging.getLogger("mixprec")


def save_accelerator_state(acc, target: Path, custom: list) -> Path:
    """Collective: write everything ``acc`` prepared (and ``custom`` objects) to ``target``."""
    import mixprec

    for i, dl in enumerate(acc.prepared.dataloaders):
        if not isinstance(dl, ResumableDataLoader) and acc.gradient_state.active_dataloaders:
            raise ValueError(
                f"save_state() was called while iterating, but prepared dataloader {i} does not track "
                "its position; call mixprec.checkpoint.make_resumable(loader) right after prepare()"
            )
    shards = acc.engine.state_shards(acc.prepared.models, acc.prepared.raw_optimizers())
    objects = None
    if acc.state.rank == 0:
        objects = {
            "optimizers": [
                {
                    "class": _class_name(o.optimizer),
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
                    "group_sizes": [len(g["params"]) for g in o.param_groups],
                    **o.step_record(),
                }
                for o in acc.prepared.optimizers
            ],
            "scaler": acc.engine.scaler_state_dict(),
            "schedulers": [s.state_dict() for s in acc.prepared.schedulers],
            "gradient_state": {"step": acc.gradient_state.step, "sync_gradients": acc.gradient_state.sync_gradients},
            "custom": [obj.state_dict() for obj in custom],
            "num_models": len(acc.prepared.models),
            "num_dataloaders": len(acc.prepared.dataloaders),
        }
    rank_state = {
        "rng": capture_rng(),
        "dataloaders": [dl.checkpoint_state() if isinstance(dl, ResumableDataLoader) else None for dl in acc.prepared.dataloaders],
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


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def load_accelerator_state(acc, source: Path, custom: list):
    """Collective: verify ``source``, validate it against ``acc`` on every rank, agree, then
    restore everything ([Note: two-phase load]). ``source`` is a mixprec checkpoint or a
    folder written by Accelerate's ``save_state`` (checkpoint/accelerate_folder.py).
    Returns the reader it loaded from."""
    outcome = None
    try:
        # A folder written by Accelerate's save_state is read through the same checks
        # (checkpoint/accelerate_folder.py); everything else must be a mixprec checkpoint.
        restore_moved_aside(Path(source))  # [Note: interrupted overwrite] in checkpoint/writer.py
        # Each rank verifies its share of the bytes ([Note: verified shares], reader.py); the
        # agreement below makes every share's verdict everybody's before anything changes.
        reader = (AccelerateFolder(source, acc, custom) if is_accelerate_folder(source)
                  else CheckpointReader(source, share=(acc.state.rank, acc.state.world_size)))
        objects = reader.objects()
        _check_objects(reader, objects)
        own_state = reader.rank_state(acc.state.rank)
        mine = own_state if own_state is not None else reader.rank_state(0)
        if mine is None:
            raise CheckpointError(f"checkpoint {str(reader.path)!r} has no {fmt.rank_file(0)}; nothing was loaded")
        _check_rank_state(reader, mine, acc.state.rank)
        _validate(acc, reader, objects, custom)
        _validate_dataloaders(acc, mine)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
        outcome = f"{type(e).__name__}: {e}"
    outcomes = collectives.gather_object(acc.state, outcome)
    errors = [f"rank {r}: {o}" for r, o in enumerate(outcomes) if o is not None]
    if errors:
        # The same text on every rank (each rank's problem names its own path).
        raise CheckpointError("load_state() loaded nothing, on any rank: " + "; ".join(errors))
    if isinstance(reader, CheckpointReader):
        # every rank verified its share and all agreed: the engine reads straight into its
        # tensors from here on ([Note: verified shares] in reader.py)
        reader.shares_agreed()
    try:
        acc.engine.load_state_shards(acc.prepared.models, acc.prepared.raw_optimizers(), reader)
    finally:
        if isinstance(reader, CheckpointReader):
            reader.release()
    for opt, saved in zip(acc.prepared.optimizers, objects["optimizers"]):
        for group, hyper in zip(opt.param_groups, saved["param_groups"]):
            group.update(hyper)
        opt.load_step_record(saved)
    if objects["scaler"] or acc.engine.scaler is not None:
        if objects["scaler"]:
            acc.engine.load_scaler_state_dict(objects["scaler"])
        else:
            logger.warning("mixprec: %s holds no loss-scaler state; the scaler starts fresh", source)
    for sched, sd in zip(acc.prepared.schedulers, objects["schedulers"]):
        sched.load_state_dict(sd)
    acc.gradient_state.step = objects["gradient_state"]["step"]
    acc.gradient_state.sync_gradients = objects["gradient_state"]["sync_gradients"]
    for obj, sd in zip(custom, objects["custom"]):
        obj.load_state_dict(sd)
    own = own_state is not None
    if not own:
        logger.warning(
            "mixprec: %s was saved by %d process(es); rank %d keeps its RNG state",
            source, reader.world_size, acc.state.rank,
        )
    for i, (dl, saved) in enumerate(zip(acc.prepared.dataloaders, mine["dataloaders"])):
        if saved is not None:
            if not own:
                # Another rank's generator states: not this rank's read ahead to replay
                # ([Note: the batch read ahead] in checkpoint/dataloader.py).
                saved = dict(saved, read_rng=None)
            _resumable(dl).load_checkpoint_state(saved, i)  # a StatefulPreparedDataLoader's own
    if own:
        restore_rng(mine["rng"])
    return reader


def _resumable(dl):
    from .dataloader import make_resumable

    return make_resumable(dl)


def _validate(acc, reader: CheckpointReader, objects: dict, custom: list) -> None:
    """Raise listing every mismatch between the checkpoint and what ``acc`` prepared."""
    expected = acc.engine.state_names(acc.prepared.models)
    saved = {n: shape for n, (shape, _) in reader.index.items() if not n.startswith(fmt.OPTIM_PREFIX)}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    misshaped = sorted(f"{n}: checkpoint {saved[n]} vs model {expected[n]}" for n in set(saved) & set(expected) if saved[n] != expected[n])
    param_keys = {n[len("model/"):] if n.startswith("model/") else n for n in expected}
    problems = []
    for n in reader.names(fmt.OPTIM_PREFIX):
        _, j, rest = n.split("/", 2)
        key = rest.rsplit("/", 1)[0]
        if int(j) >= len(acc.prepared.optimizers):
            problems.append(f"optimizer state {n!r} for optimizer {j}, but {len(acc.prepared.optimizers)} optimizer(s) were prepared")
        elif key not in param_keys:
            unexpected.append(n)
    dtypes = _expected_dtypes(acc)
    mistyped = sorted(
        f"{n}: checkpoint dtype {reader.index[n][1]} vs model {dtypes[n]}"
        for n in set(saved) & set(dtypes) if reader.index[n][1] != dtypes[n]
    )
    if missing or unexpected or misshaped or mistyped:
        raise CheckpointError(
            f"checkpoint {str(reader.path)!r} does not match the prepared model(s): missing keys {missing}, "
            f"unexpected keys {unexpected}, mis-shaped keys {misshaped}, mis-typed keys {mistyped}. Build the same model as when "
            "saving (renamed layers change keys)"
        )
    counts = [
        ("models", objects["num_models"], len(acc.prepared.models)),
        ("optimizers", len(objects["optimizers"]), len(acc.prepared.optimizers)),
        ("schedulers", len(objects["schedulers"]), len(acc.prepared.schedulers)),
        ("dataloaders", objects["num_dataloaders"], len(acc.prepared.dataloaders)),
        ("objects registered for checkpointing", len(objects["custom"]), len(custom)),
    ]
    for what, theirs, ours in counts:
        if theirs != ours:
            problems.append(f"the checkpoint holds {theirs} {what} but {ours} were prepared/registered")
    if not problems:
        problems += _validate_optimizers(acc, reader, objects, dtypes, expected)
    for j, (opt, saved_opt) in enumerate(zip(acc.prepared.optimizers, objects["optimizers"])):
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


# Keys and types of what save_accelerator_state writes into objects.pt / rank<r>.pt.
_OBJECT_FIELDS = {"optimizers": list, "scaler": dict, "schedulers": list, "gradient_state": dict,
                  "custom": list, "num_models": int, "num_dataloaders": int}
_OPTIMIZER_FIELDS = {"param_groups": list, "group_sizes": list, "skipped": int}
_RANK_FIELDS = {"rng": dict, "dataloaders": list}
_DATALOADER_FIELDS = {"yielded": int, "in_progress": bool, "total_batch_size": int}


def _check_fields(where: str, obj, fields: dict) -> None:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} must be a dict, got {type(obj).__name__}; nothing was loaded")
    for key, kind in fields.items():
        if key not in obj:
            raise CheckpointError(f"{where} lacks the field {key!r}; nothing was loaded")
        if not isinstance(obj[key], kind):
            raise CheckpointError(
                f"{where} field {key!r} is a {type(obj[key]).__name__} ({obj[key]!r:.80}), expected "
                f"{kind.__name__}; nothing was loaded"
            )


def _check_objects(reader: CheckpointReader, objects: dict) -> None:
    """objects.pt has every field a load reads, with the types save_state wrote."""
    where = f"checkpoint {str(reader.path)!r}: {fmt.OBJECTS}"
    _check_fields(where, objects, _OBJECT_FIELDS)
    for j, o in enumerate(objects["optimizers"]):
        _check_fields(f"{where} optimizers[{j}]", o, _OPTIMIZER_FIELDS)
        last = o.get("last", "missing")
        if last is not None:
            try:
                StepResult(**last)
            except (TypeError, AssertionError):
                raise CheckpointError(
                    f"{where} optimizers[{j}] field 'last' is {last!r:.80}, not a StepResult's fields; "
                    "nothing was loaded"
                ) from None
    if objects["scaler"]:
        _check_fields(f"{where} scaler", objects["scaler"], {"scale": float, "_growth_tracker": int})
    _check_fields(f"{where} gradient_state", objects["gradient_state"], {"step": int, "sync_gradients": bool})


def _check_rank_state(reader: CheckpointReader, mine: dict, rank: int) -> None:
    name = fmt.rank_file(rank if rank < reader.world_size else 0)
    where = f"checkpoint {str(reader.path)!r}: {name}"
    _check_fields(where, mine, _RANK_FIELDS)
    if not isinstance(mine["rng"].get("python"), list) or not torch.is_tensor(mine["rng"].get("torch")):
        raise CheckpointError(f"{where} field 'rng' lacks its python/torch generator states; nothing was loaded")
    for i, dl in enumerate(mine["dataloaders"]):
        if dl is not None:
            _check_fields(f"{where} dataloaders[{i}]", dl, _DATALOADER_FIELDS)
            read = dl.get("read_rng")  # optional: checkpoints before issue #48 lack it
            if read is not None:
                _check_fields(f"{where} dataloaders[{i}] read_rng", read, {"host": dict, "generators": dict})
                host = read["host"]
                if not isinstance(host.get("python"), list) or not torch.is_tensor(host.get("torch")):
                    raise CheckpointError(
                        f"{where} dataloaders[{i}] read_rng lacks its python/torch generator states; "
                        "nothing was loaded"
                    )


def _validate_dataloaders(acc, mine: dict) -> None:
    """The positions ``load_checkpoint_state`` will apply are whole numbers of batches here."""
    for i, (dl, saved) in enumerate(zip(acc.prepared.dataloaders, mine["dataloaders"])):
        if saved is None:
            continue
        if isinstance(dl, StatefulPreparedDataLoader):
            try:
                dl.check_stateful(saved, i)  # reads only
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            continue
        samples = saved["yielded"] * saved["total_batch_size"]
        ours = ResumableDataLoader.total_batch_size(dl)  # unbound: phase 1 changes nothing
        if samples % ours:
            raise CheckpointError(
                f"dataloader {i}: the checkpoint consumed {saved['yielded']} batches of "
                f"{saved['total_batch_size']} samples ({samples}), which is not a whole number of this "
                f"run's global batches of {ours}; use a global batch size that divides {samples}"
            )


def _expected_dtypes(acc) -> dict:
    """Global model tensor name -> the dtype this engine saves and loads it in: fp32 for
    parameters with fp32 masters (sharded engines keep one for every trainable parameter),
    the tensor's own dtype otherwise."""
    return acc.engine.state_dtypes(acc.prepared.models)


# State every parameter of these torch optimizers has once it stepped (element-wise unless
# scalar): what a checkpoint of the same class must hold, so that a checkpoint of another
# optimizer, or a damaged one, is refused before anything is loaded.
def _known_state_keys(cls_name: str, hyper: dict):
    if cls_name in ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW"):
        keys = {"step", "exp_avg", "exp_avg_sq"}
        return keys | {"max_exp_avg_sq"} if hyper.get("amsgrad") else keys
    if cls_name == "torch.optim.sgd.SGD":
        return {"momentum_buffer"} if hyper.get("momentum", 0) != 0 else set()
    return None


def _validate_optimizers(acc, reader: CheckpointReader, objects: dict, dtypes: dict, shapes: dict) -> list:
    """Class, hyper-parameter names and per-parameter state keys/shapes/dtypes of every
    optimizer, against the prepared one (problems as text)."""
    problems = []
    state_keys: dict = {}
    for n in reader.names(fmt.OPTIM_PREFIX):
        parts = n.split("/")
        if len(parts) < 4 or not parts[1].isdigit():
            problems.append(f"tensor {n!r} is not named optim/<j>/<param>/<state key>")
            continue
        j, key, skey = int(parts[1]), "/".join(parts[2:-1]), parts[-1]
        state_keys.setdefault((j, key), {})[skey] = reader.index[n]
    for j, (opt, saved) in enumerate(zip(acc.prepared.optimizers, objects["optimizers"])):
        ours = _class_name(opt.optimizer)
        theirs = saved.get("class")
        if theirs is not None and theirs != ours:
            problems.append(f"optimizer {j} is a {ours} but the checkpoint holds the state of a {theirs}")
            continue
        for g, (group, hyper) in enumerate(zip(opt.param_groups, saved["param_groups"])):
            mine = sorted(k for k in group if k != "params")
            # Checkpoints that name their class are checked by it (torch versions add
            # hyper-parameters); older ones by their hyper-parameter names.
            if not isinstance(hyper, dict) or (theirs is None and sorted(hyper) != mine):
                problems.append(
                    f"optimizer {j} ({ours}) param group {g} has the hyper-parameters {mine} but the "
                    f"checkpoint's has {sorted(hyper) if isinstance(hyper, dict) else hyper!r} (another "
                    f"optimizer class{'' if theirs is None else ': ' + theirs})"
                )
        if problems:
            continue
        hyper = saved["param_groups"][0] if saved["param_groups"] else {}
        known = _known_state_keys(ours, hyper)
        current = {tuple(sorted(st)) for st in opt.optimizer.state.values() if st}
        for (jj, key), entries in sorted(state_keys.items()):
            if jj != j:
                continue
            got = set(entries)
            expected = known if known is not None else (set(next(iter(current))) if len(current) == 1 else None)
            if expected is not None and got != expected:
                problems.append(
                    f"optimizer {j} ({ours}) state of parameter {key!r} has the keys {sorted(got)}, "
                    f"a {ours} has {sorted(expected)}"
                )
                continue
            if known is None:
                continue
            param = "model/" + key if "model/" + key in shapes else key
            pshape, pdtype = shapes.get(param), dtypes.get(param)
            for skey, (shape, dtype) in sorted(entries.items()):
                if skey == "step":
                    if fmt.numel_of(shape) != 1:
                        problems.append(f"optim/{j}/{key}/step has shape {shape}, expected a scalar")
                elif pshape is not None and (tuple(shape) != tuple(pshape) or dtype != pdtype):
                    problems.append(
                        f"optim/{j}/{key}/{skey} is {tuple(shape)} {dtype}, its parameter is "
                        f"{tuple(pshape)} {pdtype}"
                    )
    return problems
