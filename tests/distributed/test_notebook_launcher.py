"""notebook_launcher: values back, child tracebacks, pickling checked first, relaunching.

Functions "defined in a notebook" are compiled into a namespace named ``__main__`` that no
child can import, which is what a Jupyter kernel's cells are (tests/test_notebooks.py runs
the real thing in a kernel).
"""

from __future__ import annotations

import linecache
import threading

import pytest
import torch

import mixprec
from mixprec import NotebookLaunchError, notebook_launcher
from mixprec import notebook as notebook_mod
from mixprec import notebook_pickle

CELL = '''
import torch
from torch import nn
from mixprec import Accelerator

OFFSET = 10


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


def shifted(v):
    return v + OFFSET


def train(backend, steps):
    accelerator = Accelerator(backend=backend, mixed_precision="bf16", log_policy=False)
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(steps):
        loss = model(torch.randn(8, 4, generator=g)).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    weight = model.lin.weight.detach().clone()
    out = (accelerator.process_index, accelerator.num_processes, accelerator.backend, shifted(steps), weight)
    accelerator.end_training()
    return out


def fails_on(rank_to_fail):
    accelerator = Accelerator(log_policy=False)
    if accelerator.process_index == rank_to_fail:
        raise KeyError(f"no such thing on rank {rank_to_fail}")
    accelerator.wait_for_everyone()   # the other rank waits in a collective: must be stopped
    accelerator.end_training()


def uses_global():
    return LOCK.locked()


LOCK = __import__("threading").Lock()


def logs():
    import io, logging
    from mixprec.logging import get_logger, RANK_FORMAT
    from mixprec import Accelerator
    accelerator = Accelerator(log_policy=False)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(RANK_FORMAT))
    base = logging.getLogger("nb-test")
    base.addHandler(handler)
    base.setLevel(logging.INFO)
    log = get_logger("nb-test")
    log.info("once")
    log.info("everyone", main_process_only=False)
    log.warning("in turn", main_process_only=False, in_order=True)
    accelerator.end_training()
    return stream.getvalue()
'''


@pytest.fixture(scope="module")
def cell():
    namespace = {"__name__": "__main__"}
    # IPython registers each cell's source in linecache under the cell's file name.
    linecache.cache["<notebook-cell>"] = (len(CELL), None, CELL.splitlines(True), "<notebook-cell>")
    exec(compile(CELL, "<notebook-cell>", "exec"), namespace)
    yield namespace
    linecache.cache.pop("<notebook-cell>", None)


def module_level_square(x):
    return x * x


def test_notebook_functions_are_sent_by_value(cell):
    assert notebook_pickle.by_value(cell["train"]) and notebook_pickle.by_value(cell["Tiny"])
    assert not notebook_pickle.by_value(module_level_square)


@pytest.mark.slow
def test_returns_every_ranks_value_and_trains_on_zero2(cell):
    results = notebook_launcher(cell["train"], args=("zero2", 3), num_processes=2)
    assert [r[:4] for r in results] == [(0, 2, "zero2", 13), (1, 2, "zero2", 13)]
    # the ranks ended with the same weights, and training moved them from the initial ones
    assert torch.equal(results[0][4], results[1][4])
    torch.manual_seed(0)
    assert not torch.equal(results[0][4], cell["Tiny"]().lin.weight.detach())


@pytest.mark.slow
def test_launching_twice_in_a_row(cell):
    # the same cell run again: a fresh port and process group each time
    first = notebook_launcher(cell["train"], args=("ddp", 2), num_processes=2)
    second = notebook_launcher(cell["train"], args=("ddp", 2), num_processes=2)
    assert torch.equal(first[0][4], second[0][4])
    assert not torch.distributed.is_initialized()  # nothing left behind in this process


def test_child_error_is_raised_with_its_rank_and_traceback(cell):
    with pytest.raises(NotebookLaunchError) as info:
        notebook_launcher(cell["fails_on"], args=(1,), num_processes=2, timeout=120)
    err = info.value
    assert err.rank == 1
    assert "KeyError" in err.child_traceback and "no such thing on rank 1" in err.child_traceback
    assert "in fails_on" in err.child_traceback
    # the cell's source lines travel with the function: the traceback shows the line
    assert "raise KeyError" in err.child_traceback
    assert "rank 1" in str(err) and isinstance(err, mixprec.MixprecError)


def _must_not_start(*args, **kwargs):
    raise AssertionError("processes were started for an unpicklable launch")


def test_unpicklable_argument_is_refused_before_starting(cell, monkeypatch):
    monkeypatch.setattr(notebook_mod, "run_distributed", _must_not_start)
    with pytest.raises(TypeError, match=r"args\[1\] \(_thread\.lock\) cannot be pickled.*inside the function"):
        notebook_launcher(cell["train"], args=("ddp", threading.Lock()), num_processes=2)


def test_unpicklable_global_of_a_notebook_function_is_named(cell, monkeypatch):
    monkeypatch.setattr(notebook_mod, "run_distributed", _must_not_start)
    with pytest.raises(TypeError, match=r"uses the global 'LOCK'.*Create 'LOCK' inside the function"):
        notebook_launcher(cell["uses_global"], num_processes=2)


def test_nested_function_of_a_module_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(notebook_mod, "run_distributed", _must_not_start)

    def nested():
        return 1

    with pytest.raises(TypeError, match=r"nested in another function.*top level"):
        notebook_launcher(nested, num_processes=2)


@pytest.mark.parametrize("bad, match", [
    (dict(num_processes=0), "num_processes=0"),
    (dict(backend="ddp"), "backend='ddp'.*chosen by the Accelerator"),
    (dict(master_port=70000), "master_port=70000"),
    (dict(args=5), r"args=5.*args=\(5,\)"),
])
def test_bad_arguments_are_named(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        notebook_launcher(module_level_square, **{"args": (1,), **bad})


def test_rank_aware_logging_in_launched_processes(cell):
    rank0, rank1 = notebook_launcher(cell["logs"], num_processes=2)
    assert rank0.splitlines() == [
        "[rank 0/2] INFO nb-test: once",
        "[rank 0/2] INFO nb-test: everyone",
        "[rank 0/2] WARNING nb-test: in turn",
    ]
    assert rank1.splitlines() == ["[rank 1/2] INFO nb-test: everyone", "[rank 1/2] WARNING nb-test: in turn"]


def test_module_level_function_on_an_explicit_master_port():
    from mixprec.distributed.spawn import free_port

    # pickled by reference (importable), and the group re-joined on the port asked for
    assert notebook_launcher(module_level_square, args=(7,), num_processes=2, master_port=free_port()) == [49, 49]
