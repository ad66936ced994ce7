"""Read a folder written by Accelerate's ``save_state`` (single process or DDP) into a
prepared Accelerator, through the same validated two-phase load as a mixprec checkpoint.

:class:`AccelerateFolder` presents the folder with :class:`~.reader.CheckpointReader`'s
interface (``index``, ``read(name, offset, numel)``, ``objects()``, ``rank_state(rank)``),
so ``load_accelerator_state`` (checkpoint/state.py) validates it against the prepared
objects on every rank, agrees, and copies through the engine's ``load_state_shards``
exactly as for its own checkpoints. What Accelerate writes, and what becomes of it:

==============================  =============================================================
``model.safetensors`` /         the model's ``state_dict`` (``model_<i>`` for the i-th model);
``pytorch_model.bin``           names as ``model/<name>``; a ``module.``/``_orig_mod.`` prefix
                                (a wrapped model's) is dropped; a tied weight saved under one
                                of its names answers for all of them
``optimizer.bin``               ``torch.optim.Optimizer.state_dict()``: per-parameter state
                                keyed by the parameter's POSITION in the optimizer's groups;
                                named here through the prepared optimizer's groups, which keep
                                the user's order on the replicated backends (single, ddp)
``scheduler.bin``               the scheduler's ``state_dict`` (loaded as is)
``scaler.pt``                   ``GradScaler.state_dict()`` (scale, growth tracker)
``custom_checkpoint_<i>.pkl``   the ``state_dict`` of the i-th registered object
``random_states_<rank>.pkl``    per process: python, numpy, torch (and CUDA) RNG states and
                                ``Accelerator.step`` (the accumulation counter)
``sampler.bin``,                refused (see :data:`_NOT_CARRIED`)
``dl_state_dict.bin``
==============================  =============================================================

Accelerate records no dataloader position for a map-style loader: its resume is
``load_state`` then ``skip_first_batches(loader, n)``, and the loaders are left as they are
here too. Every file is read with ``torch.load(weights_only=True)`` (numpy's array and
dtype classes allowed for the RNG files, as Accelerate's own loader allows them); a
file that pickles anything else is refused naming the class and
``torch.serialization.add_safe_globals`` (unpickling runs code: allow it only for a
folder you trust).

Example::

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    accelerator.load_state("their_accelerate_checkpoint")    # dispatched here
    for batch in accelerator.skip_first_batches(loader, resume_step): ...
"""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path
from typing import Optional

import torch

from . import format as fmt
from .format import CheckpointError
from .reader import _ACCELERATE_FILES

logger = logging.getLogger("mixprec")

# Files Accelerate writes for other backends than single-process / DDP (utils/constants.py
# FSDP_MODEL_NAME; DeepSpeed's per-model checkpoint folder) and what mixprec says of them.
_FSDP = re.compile(r"^(pytorch_model_fsdp.*|optimizer_\d+)$")
_DEEPSPEED = re.compile(r"^pytorch_model(_\d+)?$")

# Accelerate files mixprec does not translate: file pattern -> why, and the way out.
_NOT_CARRIED = {
    re.compile(r"^dl_state_dict(_\d+)?\.bin$"): (
        "holds the state of Accelerate's StatefulDataLoader (use_stateful_dataloader=True), a torchdata "
        "state of Accelerate's own sampler classes that mixprec's loaders cannot take"
    ),
    re.compile(r"^sampler(_\d+)?\.bin$"): (
        "holds a pickled Accelerate SeedableRandomSampler (with its dataset), which mixprec's loaders "
        "cannot take"
    ),
}
_NOT_CARRIED_WAY_OUT = (
    "To load everything else, move {file} out of the folder: the dataloader then starts its pass "
    "at the beginning, as Accelerate's own resume of a map-style loader does; skip the consumed "
    "batches with accelerator.skip_first_batches(loader, n)"
)

# RNG keys of Accelerate's random_states_<rank>.pkl for devices mixprec does not run on.
_OTHER_DEVICE_RNG = ("torch_xpu_manual_seed", "torch_mlu_manual_seed", "torch_sdaa_manual_seed",
                     "torch_musa_manual_seed", "torch_hpu_manual_seed", "torch_neuron_manual_seed", "xm_seed")

# Exact widenings: a tensor stored in the first dtype loads into the second without rounding.
_WIDENS = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float64),
           (torch.bfloat16, torch.float64), (torch.float32, torch.float64)}


def is_accelerate_folder(path) -> bool:
    """Whether ``path`` is a folder written by Accelerate's ``save_state`` (not a mixprec
    checkpoint, complete or not): it has Accelerate's RNG or optimizer files and no
    mixprec ``metadata.json`` / ``COMPLETE``."""
    path = Path(path)
    if not path.is_dir() or (path / fmt.METADATA).exists() or (path / fmt.COMPLETE).exists():
        return False
    return any(_ACCELERATE_FILES.match(p.name) and p.name.startswith(("random_states_", "optimizer"))
               for p in path.iterdir())


def _numbered(names: list, stem: str, ext: str, plain: bool = True) -> dict:
    """``{index: name}`` of ``<stem>_<i><ext>``, and of ``<stem><ext>`` as index 0 when
    ``plain`` (Accelerate names the first model/optimizer/scheduler without a number)."""
    out = {}
    for n in names:
        m = re.fullmatch(re.escape(stem) + (r"(?:_(\d+))?" if plain else r"_(\d+)") + re.escape(ext), n)
        if m:
            out[int(m.group(1) or 0)] = n
    return out


def _safe_globals() -> list:
    """What Accelerate's RNG files pickle besides tensors: numpy's RNG state array."""
    try:
        import numpy as np
    except ImportError:
        return []
    import codecs

    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    allowed += [getattr(np.dtypes, n) for n in ("UInt32DType", "Float64DType", "Int64DType")
                if hasattr(getattr(np, "dtypes", None), n)]
    return allowed


class AccelerateFolder:
    """A folder written by Accelerate's ``save_state``, validated and named for ``acc``.

    The constructor reads the headers, the optimizer / scheduler / scaler / registered-object
    states and this rank's RNG file, checks them against what ``acc`` prepared and raises a
    :class:`CheckpointError` naming the file and the problem; tensors are read on demand.
    """

    def __init__(self, path, acc, custom: list) -> None:
        self.path = Path(path)
        self._acc = acc
        names = sorted(p.name for p in self.path.iterdir())
        self._refuse_other_layouts(names)
        for pattern, why in _NOT_CARRIED.items():
            for n in names:
                if pattern.match(n):
                    raise self._error(n, why + ". " + _NOT_CARRIED_WAY_OUT.format(file=n))
        self._sources: dict = {}  # index name -> (file, key in that file)
        self._values: dict = {}  # index name -> optimizer state tensor (from its optimizer_<j>.bin)
        self._bins: dict = {}  # .bin file -> its loaded (memory-mapped) dict
        self._handles: dict = {}  # .safetensors file -> safe_open handle
        self.index: dict = {}
        self._read_models(names)
        self._optimizers = self._read_optimizers(names)
        scheduler_files = _numbered(names, "scheduler", ".bin")
        self._check_numbered(scheduler_files, len(acc.prepared.schedulers), "scheduler")
        schedulers = [self._load(scheduler_files[k]) for k in sorted(scheduler_files)]
        scaler = self._load("scaler.pt") if "scaler.pt" in names else {}
        customs = _numbered(names, "custom_checkpoint", ".pkl", plain=False)
        self._check_numbered(customs, len(custom), "object registered for checkpointing",
                             first="custom_checkpoint_0.pkl")
        rng_files = _numbered(names, "random_states", ".pkl", plain=False)
        self._rank_state, step = self._read_rng(rng_files)
        self.metadata = {"format": "accelerate save_state", "backend": "accelerate", "world_size": len(rng_files)}
        self._objects = {
            "optimizers": self._optimizers,
            "scaler": scaler,
            "schedulers": schedulers,
            # Accelerate restores Accelerator.step and leaves sync_gradients as it is.
            "gradient_state": {"step": step, "sync_gradients": bool(acc.gradient_state.sync_gradients)},
            "custom": [self._load(customs[i]) for i in sorted(customs)],
            "num_models": len(self._model_files),
            # Accelerate records no dataloaders for a map-style loader: nothing to compare.
            "num_dataloaders": len(acc.prepared.dataloaders),
        }

    # ------------------------------------------------------------- the reader interface
    @property
    def world_size(self) -> int:
        return int(self.metadata["world_size"])

    def objects(self) -> dict:
        return self._objects

    def rank_state(self, rank: int) -> Optional[dict]:
        return self._rank_state if rank == self._acc.state.rank else None

    def names(self, prefix: str = "") -> list:
        return [n for n in self.index if n.startswith(prefix)]

    def __call__(self, name: str, offset: int, numel: int) -> torch.Tensor:
        """Flat elements ``[offset, offset + numel)`` of ``name``, in its presented dtype."""
        if name not in self.index:
            raise CheckpointError(f"{str(self.path)!r} has no tensor {name!r}")
        shape, dtype = self.index[name]
        total = fmt.numel_of(shape)
        if offset < 0 or numel < 0 or offset + numel > total:
            raise ValueError(f"{name!r}: range [{offset}, {offset + numel}) outside its {total} elements")
        file, key = self._sources[name]
        if name in self._values:
            t = self._values[name]
        elif file.endswith(".safetensors"):
            t = self._handle(file).get_tensor(key)
        else:
            t = self._bin(file)[key]
        return t.reshape(-1)[offset: offset + numel].to(dtype).clone()

    # ------------------------------------------------------------------- the files
    def _error(self, file: str, problem: str) -> CheckpointError:
        return CheckpointError(f"Accelerate checkpoint {str(self.path)!r}: {file} {problem}; nothing was loaded")

    def _refuse_other_layouts(self, names: list) -> None:
        fsdp = [n for n in names if _FSDP.match(n)]
        if fsdp:
            merged = next((n for n in fsdp if (self.path / n).is_dir() and n.startswith("pytorch_model_fsdp")), None)
            how = (f" Accelerate's `accelerate merge-weights {str(self.path / merged)!r} OUT_DIR` merges its weights, "
                   "which can be loaded into the model before prepare() (optimizer, scheduler and RNG states then "
                   "start fresh)" if merged else "")
            raise CheckpointError(
                f"Accelerate checkpoint {str(self.path)!r} was written with Accelerate's FSDP ({', '.join(fsdp[:3])}); "
                f"mixprec reads the layout Accelerate writes for one process and for DDP only; nothing was loaded.{how}"
            )
        deepspeed = [n for n in names if _DEEPSPEED.match(n) and (self.path / n).is_dir()]
        if deepspeed:
            raise CheckpointError(
                f"Accelerate checkpoint {str(self.path)!r} was written with DeepSpeed ({deepspeed[0]}/); mixprec reads "
                "the layout Accelerate writes for one process and for DDP only; nothing was loaded"
            )

    def _load(self, file: str, extra_globals: Optional[list] = None):
        """``torch.load(weights_only=True)`` of one file; anything unreadable is a CheckpointError."""
        try:
            if extra_globals:
                with torch.serialization.safe_globals(extra_globals):
                    return torch.load(self.path / file, map_location="cpu", weights_only=True)
            try:
                return torch.load(self.path / file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # a file in torch's legacy (non-zip) format cannot be mapped
                    raise
                return torch.load(self.path / file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = found.group(1) if found else str(e).splitlines()[0]
            raise self._error(
                file, f"pickles {what}, which torch.load(weights_only=True) does not unpickle. If you trust this "
                f"folder (unpickling runs code), allow the class before load_state(): "
                f"torch.serialization.add_safe_globals([{what.rsplit('.', 1)[-1]}])"
            ) from None
        except (RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise self._error(file, f"cannot be read ({type(e).__name__}: {first})") from None

    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file]

    def _bin(self, file: str) -> dict:
        if file not in self._bins:
            self._bins[file] = self._load(file)
        return self._bins[file]

    def _check_numbered(self, found: dict, prepared: int, what: str, first: Optional[str] = None) -> None:
        """Files 0..n-1 of a kind, as many as the run prepared."""
        if sorted(found) != list(range(len(found))):
            raise self._error(", ".join(found[i] for i in sorted(found)),
                              f"are numbered {sorted(found)}; Accelerate writes 0..n-1 (a file is missing)")
        if len(found) != prepared:
            listed = ", ".join(found[i] for i in sorted(found)) or f"no {first or what + '.bin'}"
            raise CheckpointError(
                f"Accelerate checkpoint {str(self.path)!r} holds {len(found)} {what} state(s) ({listed}) but this run "
                f"prepared/registered {prepared}; nothing was loaded. Prepare the same objects, in the same order, "
                "as the run that saved it"
            )

    # ------------------------------------------------------------------ models
    def _read_models(self, names: list) -> None:
        acc = self._acc
        safe, pt = _numbered(names, "model", ".safetensors"), _numbered(names, "pytorch_model", ".bin")
        files = {i: safe.get(i) or pt[i] for i in set(safe) | set(pt)}
        self._check_numbered(files, len(acc.prepared.models), "model", first="model.safetensors")
        self._model_files = files
        expected = acc.engine.state_names(acc.prepared.models)
        dtypes = acc.engine.state_dtypes(acc.prepared.models)
        for i, file in sorted(files.items()):
            prefix = fmt.model_prefix(i)
            if file.endswith(".safetensors"):
                try:
                    handle = self._handle(file)
                    slices = {k: handle.get_slice(k) for k in handle.keys()}
                    stored = {k: (tuple(sl.get_shape()), sl.get_dtype()) for k, sl in slices.items()}
                except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                    raise self._error(file, f"is not a readable safetensors file ({type(e).__name__}: {e})") from None
                stored = {k: (shape, fmt.dtype_from_str(d)) for k, (shape, d) in stored.items()}
            else:
                sd = self._bin(file)
                if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
                    raise self._error(file, "is not a state_dict of tensors")
                stored = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
            ours = {n[len(prefix):] for n in expected if n.startswith(prefix)}
            strip = _wrapper_prefix(set(stored), ours)
            for key, (shape, dtype) in stored.items():
                name = prefix + key[len(strip):]
                self._add(name, file, key, shape, dtype, dtypes.get(name))
            # A tied weight is saved once (safetensors keeps one name of shared tensors).
            for name, others in _aliases(acc.prepared.models[i]).items():
                saved_as = next((strip + o for o in others if strip + o in stored), None)
                if prefix + name not in self.index and prefix + name in expected and saved_as is not None:
                    shape, dtype = stored[saved_as]
                    self._add(prefix + name, file, saved_as, shape, dtype, dtypes.get(prefix + name))

    def _add(self, name: str, file: str, key: str, shape: tuple, stored: torch.dtype, wanted) -> None:
        shown = wanted if wanted is not None and (stored, wanted) in _WIDENS else stored
        self.index[name] = (tuple(shape), shown)
        self._sources[name] = (file, key)

    # --------------------------------------------------------------- optimizers
    def _read_optimizers(self, names: list) -> list:
        acc = self._acc
        files = _numbered(names, "optimizer", ".bin")
        self._check_numbered(files, len(acc.prepared.optimizers), "optimizer", first="optimizer.bin")
        dtypes = acc.engine.state_dtypes(acc.prepared.models)
        out = []
        for j, file in sorted(files.items()):
            sd = self._bin(file)
            groups = sd.get("param_groups") if isinstance(sd, dict) else None
            state = sd.get("state") if isinstance(sd, dict) else None
            if not isinstance(groups, list) or not isinstance(state, dict) or not all(
                    isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
                raise self._error(file, "is not a torch optimizer state_dict ({'state': ..., 'param_groups': [...]})")
            opt = acc.prepared.optimizers[j]
            if len(groups) != len(opt.param_groups):
                raise self._error(file, f"holds {len(groups)} param group(s), prepared optimizer {j} has "
                                  f"{len(opt.param_groups)}. Build the optimizer with the same param groups")
            self._check_hyper(file, j, groups, opt)
            if state:
                self._name_state(file, j, groups, state, dtypes)
            out.append({
                # Accelerate does not record the class: its hyper-parameter names were checked
                # against the prepared optimizer's above, its state keys are by _validate.
                "class": f"{type(opt.optimizer).__module__}.{type(opt.optimizer).__qualname__}",
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
                "group_sizes": [len(g["params"]) for g in groups],
                "skipped": 0,
                "last": None,
            })
        return out

    def _check_hyper(self, file: str, j: int, groups: list, opt) -> None:
        # ``initial_lr`` is added by a scheduler, not by the optimizer class.
        for g, (theirs, group) in enumerate(zip(groups, opt.param_groups)):
            a = sorted(k for k in theirs if k not in ("params", "initial_lr"))
            b = sorted(k for k in group if k not in ("params", "initial_lr"))
            if a != b:
                raise self._error(
                    file, f"param group {g} has the hyper-parameters {a}, prepared optimizer {j} "
                    f"({type(opt.optimizer).__name__}) has {b}: another optimizer class (or another torch "
                    "version). Build the same optimizer as the run that saved it"
                )

    def _name_state(self, file: str, j: int, groups: list, state: dict, dtypes: dict) -> None:
        """Name each parameter's state ``optim/<j>/<param key>/<state key>`` through the
        prepared optimizer's groups (positions in Accelerate's file = positions there)."""
        acc = self._acc
        if not acc.engine.replicated_state:
            raise self._error(
                file, f"keys each parameter's optimizer state by its position in the optimizer; backend="
                f"{acc.engine.name!r} regroups the parameters into shards at prepare() and does not keep those "
                "positions. Load this folder with backend='ddp' (or in one process) and save_state() there: a "
                f"mixprec checkpoint loads on {acc.engine.name} at any world size"
            )
        keys = _optimizer_param_keys(acc, j)
        for g, (theirs, mine) in enumerate(zip(groups, keys)):
            if len(theirs["params"]) != len(mine):
                raise self._error(file, f"param group {g} holds {len(theirs['params'])} parameter(s), prepared "
                                  f"optimizer {j}'s holds {len(mine)}. Build the optimizer over the same parameters")
        position = {}
        for theirs, mine in zip(groups, keys):
            for idx, key in zip(theirs["params"], mine):
                position[idx] = key
        for idx, entries in state.items():
            if idx not in position:
                raise self._error(file, f"holds state for parameter {idx!r}, which none of its param groups lists")
            if not isinstance(entries, dict):
                raise self._error(file, f"state of parameter {idx} is a {type(entries).__name__}, not a dict")
            key = position[idx]
            param = "model/" + key if "model/" + key in dtypes else key
            for skey, value in entries.items():
                if value is None:
                    continue  # e.g. SGD's momentum_buffer before momentum is used
                if isinstance(value, (bool, int, float)):
                    value = torch.tensor(value)
                if not torch.is_tensor(value):
                    raise self._error(file, f"state {skey!r} of parameter {idx} is a {type(value).__name__}; "
                                      "mixprec loads tensors and numbers")
                name = f"{fmt.OPTIM_PREFIX}{j}/{key}/{skey}"
                self._add(name, file, f"state[{idx}][{skey!r}]", tuple(value.shape), value.dtype,
                          None if skey == "step" else dtypes.get(param))
                self._values[name] = value

    # ---------------------------------------------------------------------- RNG
    def _read_rng(self, files: dict):
        """This rank's RNG states in capture_rng()'s form, and Accelerate's step counter."""
        acc = self._acc
        world, rank = acc.state.world_size, acc.state.rank
        listed = ", ".join(files[r] for r in sorted(files))
        if not files:
            raise CheckpointError(
                f"Accelerate checkpoint {str(self.path)!r} has no random_states_<rank>.pkl (Accelerate's save_state "
                "writes one per process); nothing was loaded. Copy the folder whole"
            )
        if sorted(files) != list(range(world)):
            raise CheckpointError(
                f"Accelerate checkpoint {str(self.path)!r} holds the RNG states of {len(files)} process(es) "
                f"({listed}) but this run has {world} process(es); nothing was loaded. Resume with "
                f"{len(files)} process(es): each restores the RNG states it saved"
                if sorted(files) == list(range(len(files))) else
                f"Accelerate checkpoint {str(self.path)!r} holds {listed}: not one file per process 0..n-1 "
                "(a file is missing); nothing was loaded. Copy the folder whole"
            )
        file = files[rank]
        states = self._load(file, _safe_globals())
        if not isinstance(states, dict) or "torch_manual_seed" not in states or "random_state" not in states:
            raise self._error(file, "is not Accelerate's RNG state (no random_state / torch_manual_seed)")
        try:
            version, internal, gauss = states["random_state"]
            rng = {"python": [version, list(internal), gauss], "torch": states["torch_manual_seed"]}
            if not torch.is_tensor(rng["torch"]) or rng["torch"].dtype != torch.uint8:
                raise TypeError("torch_manual_seed is not a uint8 tensor")
            if "numpy_random_seed" in states:
                kind, keys, pos, has_gauss, cached = states["numpy_random_seed"]
                rng["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
        except (TypeError, ValueError) as e:
            raise self._error(file, f"holds a malformed RNG state ({e})") from None
        if "torch_cuda_manual_seed" in states:
            rng["cuda"] = list(states["torch_cuda_manual_seed"])
        other = [k for k in _OTHER_DEVICE_RNG if k in states]
        if other:
            logger.warning("mixprec: %s holds RNG states of devices mixprec does not run on (%s); not restored",
                           self.path / file, ", ".join(other))
        step = states.get("step", 0)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise self._error(file, f"holds step={step!r}, expected an int >= 0")
        return {"rng": rng, "dataloaders": [None] * len(acc.prepared.dataloaders)}, step


def _wrapper_prefix(stored: set, ours: set) -> str:
    """The prefix a wrapped model's state_dict adds (DDP ``module.``, torch.compile
    ``_orig_mod.``) when every saved key has it and dropping it names this model's tensors."""
    for prefix in ("module._orig_mod.", "_orig_mod.module.", "module.", "_orig_mod."):
        if stored and all(k.startswith(prefix) for k in stored) and not stored & ours:
            if {k[len(prefix):] for k in stored} & ours:
                return prefix
    return ""


def _aliases(model) -> dict:
    """Name -> the other names of the same tensor, for tensors a state_dict lists under
    several names (tied weights)."""
    names: dict = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    return {n: [o for o in group if o != n] for group in names.values() if len(group) > 1 for n in group}


def _optimizer_param_keys(acc, j: int) -> list:
    """Per param group of prepared optimizer ``j``, its parameters' keys (their names in
    their model, ``model<i>/`` prefixed for i > 0), in the group's order. On the replicated
    backends the groups hold the user's parameters (or their fp32 masters) in the order
    the optimizer was built with, which is the order of Accelerate's positions; keyed as
    engines/replicated_state.py keys them (a tensor's first state_dict name)."""
    master_of = acc.engine.precision.master_of
    key_of = {}
    for i, model in enumerate(acc.prepared.models):
        prefix = fmt.model_prefix(i)
        for name, t in model.state_dict(keep_vars=True).items():
            src = master_of.get(id(t), t)
            key_of.setdefault(id(src), name if i == 0 else prefix + name)
    out = []
    for g, group in enumerate(acc.prepared.raw_optimizers()[j].param_groups):
        keys = []
        for p in group["params"]:
            if id(p) not in key_of:
                raise CheckpointError(
                    f"prepared optimizer {j} param group {g} holds a parameter of shape {tuple(p.shape)} that "
                    "belongs to no prepared model; prepare the model that owns it; nothing was loaded"
                )
            keys.append(key_of[id(p)])
        out.append(keys)
    return out
