"""Issue #36 point 1: the names scripts import from ``accelerate``, ``accelerate.utils`` and
``accelerate.logging`` exist in ``mixprec``, ``mixprec.utils`` and ``mixprec.logging``, or are
a deliberate gap listed here with its reason (docs/migrating.md repeats the list).

Compared: every public name of the installed ``accelerate`` package (its submodules
aside) and of ``accelerate.logging``; from ``accelerate.utils`` (about 265 names, most of
them Accelerate's internals) the ones transformers' ``run_*_no_trainer.py`` scripts and
Accelerate's own examples import (``UTILS_USED``).
"""

from __future__ import annotations

import enum
import types

import pytest

accelerate = pytest.importorskip("accelerate")

import mixprec  # noqa: E402
import mixprec.logging  # noqa: E402
import mixprec.utils  # noqa: E402

_BIG_MODEL = "Accelerate's big-model inference (loading/offloading weights across devices), not training: use accelerate's own beside mixprec"
_PLUGIN = ("configure the backend with Accelerator(backend=..., config=...) (docs/configuration.md); a DeepSpeed "
           "JSON converts with `mixprec config import FILE`")
GAPS = {
    "accelerate": {
        "AutocastKwargs": "use accelerator.autocast(enabled=...) or mixed_precision=; Accelerate's own instance works as "
                          "accelerator.autocast(handler) (kwargs_handlers refuses it naming that)",
        "ProfileKwargs": "use accelerator.profile(), which takes Accelerate's own instance, or torch.profiler.profile "
                         "(kwargs_handlers refuses it naming that)",
        "DDPCommunicationHookType": "mixprec's ddp engine has no communication hooks (it reduces in fp32 itself)",
        "DeepSpeedPlugin": _PLUGIN,
        "FullyShardedDataParallelPlugin": _PLUGIN,
        "ParallelismConfig": "tensor/sequence parallelism are config sections (docs/tensor_parallel.md, docs/sequence_parallel.md)",
        "cpu_offload": _BIG_MODEL,
        "cpu_offload_with_hook": _BIG_MODEL,
        "disk_offload": _BIG_MODEL,
        "dispatch_model": _BIG_MODEL,
        "infer_auto_device_map": _BIG_MODEL,
        "init_on_device": _BIG_MODEL,
        "load_checkpoint_and_dispatch": _BIG_MODEL,
        "load_checkpoint_in_model": _BIG_MODEL,
        "prepare_pippy": "pipeline-parallel inference is not provided",
        "debug_launcher": "use mixprec.notebook_launcher or `mixprec launch`",
        "is_rich_available": "mixprec does not use rich",
        "synchronize_rng_states": "prepared dataloaders agree on each pass's order themselves ([Note: one pass "
                                  "order on every rank], src/mixprec/data/sharding.py)",
    },
    "accelerate.utils": {
        "LoggerType": "log_with takes tracker names as strings; Accelerate's LoggerType members are accepted as they are",
        "ProfileKwargs": "use torch.profiler.profile around the loop",
        "DDPCommunicationHookType": "mixprec's ddp engine has no communication hooks",
        "MegatronLMDummyScheduler": "Megatron-LM is not a mixprec backend",
        "write_basic_config": "`mixprec config` writes a config file",
    },
    "accelerate.logging": {},
}

UTILS_USED = [
    "set_seed", "DistributedType", "ProjectConfiguration", "GradientAccumulationPlugin", "DataLoaderConfiguration",
    "DistributedDataParallelKwargs", "InitProcessGroupKwargs", "GradScalerKwargs", "find_executable_batch_size",
    "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
    "send_to_device", "LoggerType", "ProfileKwargs", "DDPCommunicationHookType", "MegatronLMDummyScheduler",
    "write_basic_config",
]


def _public(module, defined_in: str) -> list[str]:
    """``module``'s public names whose objects come from ``defined_in`` (a package: its modules too)."""
    return sorted(n for n, v in vars(module).items()
                  if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"
                  and getattr(v, "__module__", module.__name__).split(".")[:len(defined_in.split("."))]
                  == defined_in.split("."))


def _compared() -> dict[str, tuple[object, list[str]]]:
    import accelerate.logging
    import accelerate.utils

    return {"accelerate": (mixprec, _public(accelerate, "accelerate")),
            "accelerate.utils": (mixprec.utils, UTILS_USED),
            "accelerate.logging": (mixprec.logging, _public(accelerate.logging, "accelerate.logging"))}


def test_accelerate_names_exist_in_mixprec_or_are_listed_gaps():
    import importlib

    missing, stale = [], []
    for theirs, (ours, names) in _compared().items():
        their_module = importlib.import_module(theirs)
        for name in names:
            assert hasattr(their_module, name), f"{theirs}.{name} is compared but accelerate has no such name"
            has = hasattr(ours, name)
            if not has and name not in GAPS[theirs]:
                missing.append(f"{theirs}.{name}")
            if has and name in GAPS[theirs]:
                stale.append(f"{theirs}.{name}")
    assert not missing, f"names missing from mixprec and not listed as gaps: {missing}"
    assert not stale, f"listed as gaps but mixprec has them (drop them from GAPS and docs/migrating.md): {stale}"
    # The scripts' imports, exactly.
    assert {"Accelerator", "DistributedType", "skip_first_batches", "find_executable_batch_size"} <= set(dir(mixprec))
    assert _compared()["accelerate.logging"][1] == ["MultiProcessAdapter", "get_logger"]
    assert len(_compared()["accelerate"][1]) >= 25


def test_distributed_type_has_every_accelerate_member_and_the_tpu_alias():
    from accelerate.utils import DistributedType as Theirs

    from mixprec import DistributedType as Ours
    from mixprec.utils import DistributedType as FromUtils

    assert FromUtils is Ours
    assert [m.name for m in Ours] == [m.name for m in Theirs]
    assert all(Ours[m.name] == m for m in Theirs)  # str enums: equal across the libraries
    assert Ours.TPU is Ours.XLA  # older Accelerate's name, as in older copies of the scripts
    assert issubclass(Ours, enum.Enum)


def test_set_seed_seeds_every_generator_like_accelerate():
    import random

    import numpy as np
    import torch
    from accelerate.utils import set_seed as theirs

    from mixprec.utils import set_seed as ours

    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    theirs(123)
    expected = draw()
    ours(123)
    assert draw() == expected
    with pytest.raises(TypeError, match=r"set_seed\(seed='1'\) needs an int"):
        ours("1")


def test_utils_classes_are_the_accelerator_s_own():
    from mixprec.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs, GradientAccumulationPlugin,
                               InitProcessGroupKwargs, ProjectConfiguration)

    assert (DataLoaderConfiguration, DistributedDataParallelKwargs, GradientAccumulationPlugin, InitProcessGroupKwargs,
            ProjectConfiguration) == (mixprec.DataLoaderConfiguration, mixprec.DistributedDataParallelKwargs,
                                      mixprec.GradientAccumulationPlugin, mixprec.InitProcessGroupKwargs,
                                      mixprec.ProjectConfiguration)
    with pytest.raises(AttributeError, match="mixprec.utils' has no attribute 'no_such_name'"):
        mixprec.utils.no_such_name  # noqa: B018


def test_find_executable_batch_size_retries_smaller_on_out_of_memory_only():
    from mixprec.utils import find_executable_batch_size

    tried = []

    @find_executable_batch_size(starting_batch_size=10)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 7:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * scale

    assert train(2) == 14 and tried == [10, 9, 8, 7]
    with pytest.raises(TypeError, match="the decorator passes it"):
        train(7, 2)

    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()


def test_migrating_note_lists_every_compared_name_and_gap():
    from pathlib import Path

    note = (Path(__file__).resolve().parents[1] / "docs" / "migrating.md").read_text()
    unlisted = [f"{theirs}.{name}" for theirs, (_, names) in _compared().items() for name in names
                if f"`{name}`" not in note]
    assert not unlisted, f"docs/migrating.md does not name these compared names: {unlisted}"
