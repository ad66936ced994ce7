"""Run the test scripts shipped in Accelerate's wheel, one check at a time, under either library.

Used by tests/distributed/test_accelerate_compat.py. Each rank runs::

    python accelerate_checks.py {accelerate|mixprec} OUT_DIR CHECK [CHECK ...]

with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). The scripts are read from
the installed ``accelerate/test_utils/scripts/`` and written to a temporary copy; for
``mixprec`` one line is added after their imports, ``from mixprec import Accelerator``,
so only the Accelerator class changes (everything else, ``DataLoaderConfiguration``,
``RegressionModel``, ``gather``..., stays Accelerate's). ``test_ops.py``, which has no
Accelerator, gets the import (Accelerate's or mixprec's) so its checks can take
``Accelerator().state``. ``external_deps/test_metrics.py`` also loses its
``datasets``/``evaluate``/``transformers`` imports, which only its MRPC check (not run
here) uses. Checks named ``...[own_state]`` rebind a few module names first (see
:func:`state_overrides`). ``RegressionDataset``s the scripts build unseeded get a seed (see
:func:`seeded_regression_dataset`), so a check's data does not change from run to run.

Every check appends one JSON line ``{"check", "ok", "error"}`` to ``OUT_DIR/rank<r>.jsonl``
as soon as it ends, so a harness can tell which check hung or crashed a rank and restart
the run after it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

SCRIPTS = {
    "sync": "test_sync.py",
    "script": "test_script.py",
    "loop": "test_distributed_data_loop.py",
    "ops": "test_ops.py",
    "metrics": "external_deps/test_metrics.py",
}

# name -> (script, python expression evaluated in the script's namespace, world sizes it runs on)
# The expressions are what the scripts' own main() calls on a CPU machine; checks main()
# runs only on GPUs but that also pass under Accelerate on CPU are included (the
# split_batches / sync_each_batch variants of the accumulation checks).
CHECKS: dict[str, tuple[str, str, tuple[int, ...]]] = {
    # test_ops.py: the state Accelerator().state gives, through accelerate.utils.operations
    "ops.gather": ("ops", "test_gather(Accelerator().state)", (1, 2)),
    "ops.gather_object": ("ops", "test_gather_object(Accelerator().state)", (1, 2)),
    "ops.gather_non_contiguous": ("ops", "test_gather_non_contiguous(Accelerator().state)", (1, 2)),
    "ops.broadcast": ("ops", "test_broadcast(Accelerator().state)", (1, 2)),
    "ops.pad_across_processes": ("ops", "test_pad_across_processes(Accelerator().state)", (1, 2)),
    "ops.reduce_sum": ("ops", "test_reduce_sum(Accelerator().state)", (2,)),
    "ops.reduce_mean": ("ops", "test_reduce_mean(Accelerator().state)", (2,)),
    "ops.reduce_max": ("ops", "test_reduce_max(Accelerator().state)", (2,)),
    "ops.op_checker": ("ops", "test_op_checker(Accelerator().state)", (2,)),
    # The same through the Accelerator's own gather / pad_across_processes / reduce (the
    # module-level accelerate.utils functions read Accelerate's PartialState singleton).
    "ops.gather[own_state]": ("ops", "test_gather(Accelerator().state)", (1, 2)),
    "ops.gather_non_contiguous[own_state]": ("ops", "test_gather_non_contiguous(Accelerator().state)", (1, 2)),
    "ops.pad_across_processes[own_state]": ("ops", "test_pad_across_processes(Accelerator().state)", (1, 2)),
    "ops.reduce_sum[own_state]": ("ops", "test_reduce_sum(Accelerator().state)", (2,)),
    "ops.reduce_mean[own_state]": ("ops", "test_reduce_mean(Accelerator().state)", (2,)),
    "ops.reduce_max[own_state]": ("ops", "test_reduce_max(Accelerator().state)", (2,)),
    # test_sync.py
    "sync.dataloader_break": ("sync", "test_dataloader_break()", (1, 2)),
    "sync.noop_sync": ("sync", "test_noop_sync(Accelerator())", (1,)),
    "sync.distributed_sync": ("sync", "test_distributed_sync(Accelerator())", (2,)),
    "sync.distributed_sync_multiple_fwd": ("sync", "test_distributed_sync_multiple_fwd(Accelerator())", (2,)),
    "sync.accumulation": ("sync", "test_gradient_accumulation(False, False, False)", (1, 2)),
    "sync.accumulation_split": ("sync", "test_gradient_accumulation(True, False, False)", (2,)),
    "sync.accumulation_sync_each_batch": ("sync", "test_gradient_accumulation(False, False, True)", (2,)),
    "sync.accumulation_split_sync_each_batch": ("sync", "test_gradient_accumulation(True, False, True)", (2,)),
    "sync.accumulation_opt_sched": ("sync", "test_gradient_accumulation_with_opt_and_scheduler()", (1, 2)),
    "sync.accumulation_opt_sched_split": (
        "sync", "test_gradient_accumulation_with_opt_and_scheduler(True, False, False)", (2,)),
    "sync.accumulation_opt_sched_sync_each_batch": (
        "sync", "test_gradient_accumulation_with_opt_and_scheduler(False, False, True)", (2,)),
    "sync.accumulation_opt_sched_split_sync_each_batch": (
        "sync", "test_gradient_accumulation_with_opt_and_scheduler(True, False, True)", (2,)),
    # test_script.py
    "script.process_execution": ("script", "process_execution_check()", (1, 2)),
    "script.seedable_sampler": ("script", "check_seedable_sampler()", (1, 2)),
    "script.seedable_sampler_with_data_seed": ("script", "check_seedable_sampler_with_data_seed()", (1, 2)),
    "script.seedable_sampler_in_batch_sampler_shard": (
        "script", "check_seedable_sampler_in_batch_sampler_shard()", (2,)),
    "script.training": ("script", "training_check(use_seedable_sampler=False)", (1, 2)),
    "script.training_seedable_sampler": ("script", "training_check(use_seedable_sampler=True)", (1, 2)),
    # The same, with the script's AcceleratorState import changed to the library's own
    # (mixprec.AcceleratorState under mixprec: docs/migrating.md) and are_the_same_tensors,
    # Accelerate's helper that reads Accelerate's singleton, given the Accelerator under
    # test: see state_overrides().
    "script.training[own_state]": ("script", "training_check(use_seedable_sampler=False)", (1, 2)),
    "script.training_seedable_sampler[own_state]": ("script", "training_check(use_seedable_sampler=True)", (1, 2)),
    "script.trigger": ("script", "test_trigger()", (1, 2)),
    "script.reinstantiated_state": ("script", "test_reinstantiated_state()", (1, 2)),
    "script.reinstantiated_state[own_state]": ("script", "test_reinstantiated_state()", (1, 2)),
    # test_distributed_data_loop.py (asserts two processes)
    "loop.even_batches": ("loop", "test_default_ensures_even_batch_sizes()", (2,)),
    "loop.disable_even_batches": ("loop", "test_can_disable_even_batches()", (2,)),
    "loop.join_uneven_inputs": ("loop", "test_can_join_uneven_inputs()", (2,)),
    "loop.join_overrides_even_batches": ("loop", "test_join_can_override_even_batches()", (2,)),
    "loop.join_mixed_type_dataloaders": ("loop", "test_join_can_override_for_mixed_type_dataloaders()", (2,)),
    "loop.join_iterable_warning": ("loop", "test_join_raises_warning_for_iterable_when_overriding_even_batches()", (2,)),
    "loop.pickle_accelerator": ("loop", "test_pickle_accelerator()", (2,)),
    "loop.stateful_dataloader": ("loop", "test_stateful_dataloader(create_accelerator())", (2,)),
    "loop.stateful_dataloader_save_state": ("loop", "test_stateful_dataloader_save_state(create_accelerator())", (2,)),
    "loop.data_loader_no_shuffle": (
        "loop", "test_data_loader(DataLoader(DummyDataset(), shuffle=False, batch_size=BATCH_SIZE, "
        "num_workers=NUM_WORKERS), create_accelerator())", (2,)),
    "loop.data_loader_shuffle": (
        "loop", "test_data_loader(DataLoader(DummyDataset(), shuffle=True, batch_size=BATCH_SIZE, "
        "num_workers=NUM_WORKERS), create_accelerator())", (2,)),
    "loop.data_loader_batch_sampler": (
        "loop", "test_data_loader(DataLoader(DummyDataset(), batch_sampler=BatchSampler(RandomSampler("
        "DummyDataset()), batch_size=BATCH_SIZE, drop_last=False), num_workers=NUM_WORKERS), "
        "create_accelerator())", (2,)),
    "loop.data_loader_sampler_is_batch_sampler": (
        "loop", "test_data_loader(DataLoader(DummyDataset(), sampler=BatchSampler(RandomSampler("
        "DummyDataset()), batch_size=BATCH_SIZE, drop_last=False), batch_size=None, "
        "collate_fn=default_collate, num_workers=NUM_WORKERS), create_accelerator())", (2,)),
    # external_deps/test_metrics.py, the checks without datasets/evaluate
    "metrics.torch_metrics_99": (
        "metrics", "test_torch_metrics(Accelerator(dataloader_config=DataLoaderConfiguration("
        "split_batches=False, dispatch_batches=False)), 99)", (1, 2)),
    "metrics.torch_metrics_99_split": (
        "metrics", "test_torch_metrics(Accelerator(dataloader_config=DataLoaderConfiguration("
        "split_batches=True, dispatch_batches=False)), 99)", (1, 2)),
    "metrics.torch_metrics_99_dispatch": (
        "metrics", "test_torch_metrics(Accelerator(dataloader_config=DataLoaderConfiguration("
        "split_batches=False, dispatch_batches=True)), 99)", (1, 2)),
    "metrics.torch_metrics_99_split_dispatch": (
        "metrics", "test_torch_metrics(Accelerator(dataloader_config=DataLoaderConfiguration("
        "split_batches=True, dispatch_batches=True)), 99)", (1, 2)),
    "metrics.torch_metrics_512": ("metrics", "test_torch_metrics(Accelerator(), 512)", (1, 2)),
    "metrics.drop_last": ("metrics", "test_gather_for_metrics_drop_last()", (1, 2)),
    "metrics.iterable_dataset": ("metrics", "test_gather_for_metrics_with_iterable_dataset()", (1, 2)),
    "metrics.non_tensor_iterable_dataset": (
        "metrics", "test_gather_for_metrics_with_non_tensor_objects_iterable_dataset()", (1, 2)),
}

_DROPPED_IMPORTS = re.compile(r"^(import (datasets|evaluate|transformers)|from (datasets|transformers) import .*)$", re.M)


def state_overrides(module, library: str) -> dict:
    """For the ``[own_state]`` checks: the script's ``AcceleratorState``/``PartialState`` are
    the library's own (under mixprec: ``mixprec.AcceleratorState``/``mixprec.PartialState``,
    the import docs/migrating.md tells such scripts to change), and Accelerate's helpers that
    read Accelerate's singleton whatever the script imports (``are_the_same_tensors``, and
    test_ops.py's ``gather``/``pad_across_processes``/``reduce``) go through the Accelerator
    under test."""
    import torch

    accelerator_cls = module.Accelerator
    overrides = {}
    if library == "mixprec":
        import mixprec

        overrides.update(AcceleratorState=mixprec.AcceleratorState, PartialState=mixprec.PartialState)

    def are_the_same_tensors(tensor):
        acc = accelerator_cls()
        gathered = acc.gather(tensor[None].clone().to(acc.device)).cpu()
        return all(torch.equal(gathered[0], t) for t in gathered)

    overrides["are_the_same_tensors"] = are_the_same_tensors
    if hasattr(module, "gather"):
        acc = accelerator_cls()
        overrides.update(gather=acc.gather, pad_across_processes=acc.pad_across_processes, reduce=acc.reduce)
    return {k: v for k, v in overrides.items() if hasattr(module, k)}


def checks_for(world_size: int) -> list[str]:
    return [name for name, (_, _, worlds) in CHECKS.items() if world_size in worlds]


def patched_source(script: str, library: str) -> str:
    import accelerate

    root = Path(accelerate.__file__).parent / "test_utils" / "scripts"
    text = (root / SCRIPTS[script]).read_text()
    if script == "metrics":
        text = _DROPPED_IMPORTS.sub("", text)
    line = None
    if library == "mixprec":
        line = "from mixprec import Accelerator  # the only change (mixprec compat test)"
    elif script == "ops":
        line = "from accelerate import Accelerator  # test_ops.py uses the state alone"
    if line is not None:
        # Right after the last top-level import statement.
        end = max(node.end_lineno for node in ast.parse(text).body
                  if isinstance(node, (ast.Import, ast.ImportFrom)))
        lines = text.split("\n")
        lines.insert(end, line)
        text = "\n".join(lines)
    return text


def seeded_regression_dataset(base: type, rank: int) -> type:
    """Accelerate's ``RegressionDataset(seed=None)`` draws its data from OS entropy, so the
    scripts that build it unseeded (test_sync.py, test_metrics.py) see new data on every
    run. Their accumulation checks compare a model that took extra optimizer steps with one
    that did not, under ``rtol=1e-2``: whether that holds depends on the draw. Replaying
    that arithmetic on 2000 fresh draws, 4 fail (0.2%), under either library; one did fail
    a CI run. The unseeded datasets here get a seed from (rank, how many were built before
    in this process): every rank and every dataset still has its own data, as in the
    scripts, but every run of the same checks, under either library, sees the same data."""

    class SeededRegressionDataset(base):
        built = 0

        def __init__(self, *args, seed=None, **kwargs):
            if seed is None:
                seed = [rank, SeededRegressionDataset.built]
                SeededRegressionDataset.built += 1
            super().__init__(*args, seed=seed, **kwargs)

    return SeededRegressionDataset


def load(script: str, library: str, tmp: Path):
    path = tmp / f"{script}_{library}.py"
    path.write_text(patched_source(script, library))
    spec = importlib.util.spec_from_file_location(f"accel_check_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "RegressionDataset"):
        module.RegressionDataset = seeded_regression_dataset(module.RegressionDataset,
                                                             int(os.environ.get("RANK", "0")))
    return module


def hosted_store(timeout_s: float = 900.0):
    """A rendezvous store hosted by this process (tests/distributed/harness.py's, importable
    here when this file runs as a script)."""
    from harness import hosted_store as hosted

    return hosted(timeout_s)


def rank_env(rank: int, world_size: int, port: int, torch_agent: bool = False) -> dict:
    from mixprec.distributed.spawn import rank_env as env

    return env(rank, world_size, port, torch_agent=torch_agent)


def run_checks(library: str, world_size: int, names: list[str], out: Path,
               stall_s: float = 60.0, python: str = sys.executable) -> dict[str, str]:
    """Run ``names`` on ``world_size`` ranks; returns {check: "ok" | failure text}.

    A check passes when it passed on every rank. When no rank reports a result for
    ``stall_s`` seconds (a rank died, or waits on a collective the others left), the ranks
    are killed, the current check is failed, and a fresh set of ranks goes on with the rest.
    """
    import subprocess
    import time

    from mixprec.distributed.rendezvous import host_store

    results: dict[str, str] = {}
    remaining = list(names)
    attempt = 0
    while remaining:
        attempt += 1
        d = out / f"{library}-w{world_size}-{attempt}"
        d.mkdir(parents=True)
        store = host_store(timeout_s=900)  # the ranks join it ([Note: a store bound where it is asked to listen])
        procs, logs = [], []
        for rank in range(world_size):
            env = dict(os.environ, **rank_env(rank, world_size, store.port, torch_agent=True), OMP_NUM_THREADS="1")
            logs.append(open(d / f"stdout{rank}.txt", "w"))
            procs.append(subprocess.Popen(
                [python, __file__, library, str(d), *remaining], env=env,
                stdout=logs[-1], stderr=subprocess.STDOUT))

        def reported() -> list[dict[str, dict]]:
            per_rank = []
            for rank in range(world_size):
                f = d / f"rank{rank}.jsonl"
                lines = f.read_text().splitlines() if f.exists() else []
                per_rank.append({r["check"]: r for r in map(json.loads, lines) if r})
            return per_rank

        last_count, last_change = -1, time.monotonic()
        while True:
            count = sum(len(r) for r in reported())
            if count != last_count:
                last_count, last_change = count, time.monotonic()
            if all(p.poll() is not None for p in procs) or time.monotonic() - last_change > stall_s:
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        del store
        for f in logs:
            f.close()
        per_rank = reported()
        for name in list(remaining):
            rows = [r.get(name) for r in per_rank]
            if all(row is not None for row in rows):
                errors = [f"rank {i}: {row['error']}" for i, row in enumerate(rows) if not row["ok"]]
                results[name] = "ok" if not errors else "\n".join(errors)
                remaining.remove(name)
                continue
            # The first check some rank did not finish: it hung or killed a rank.
            logs = "".join((d / f"stdout{i}.txt").read_text()[-2000:] for i in range(world_size))
            results[name] = "no result from every rank (hang or crash); output tail:\n" + logs
            remaining.remove(name)
            break
    return results


def main(argv: list[str]) -> int:
    library, out, names = argv[0], Path(argv[1]), argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise SystemExit(f"unknown checks {unknown}; known: {sorted(CHECKS)}")
    # What `accelerate launch --cpu` exports; the scripts' own accelerate.utils calls
    # (gather, prepare_data_loader...) read it under either library.
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"rank{rank}.jsonl", "a", buffering=1)
    modules = {}
    with tempfile.TemporaryDirectory() as tmp:
        # process_execution_check has every rank append to one file in the current directory.
        shared = out / "cwd"
        shared.mkdir(exist_ok=True)
        os.chdir(shared)
        for name in names:
            script, expr, _ = CHECKS[name]
            error = None
            try:
                if script not in modules:
                    modules[script] = load(script, library, Path(tmp))
                module = modules[script]
                overrides = state_overrides(module, library) if name.endswith("[own_state]") else {}
                saved = {k: getattr(module, k) for k in overrides}
                vars(module).update(overrides)
                try:
                    eval(expr, vars(module))  # noqa: S307 - expressions from CHECKS above
                finally:
                    vars(module).update(saved)
            except BaseException as e:  # noqa: BLE001 - report every failure, the run goes on
                error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
            log.write(json.dumps({"check": name, "ok": error is None, "error": error}) + "\n")
    log.close()
    # Leave without running interpreter-exit teardown of half-failed collectives.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
