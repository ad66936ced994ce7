"""Issue #36 point 5 on 2 processes: a folder written by Accelerate's ``save_state`` under
DDP (one ``random_states_<rank>.pkl`` per process) loads into mixprec's ddp backend, each
rank restoring its own RNG states, and the run continues as Accelerate's own resume does.

Accelerate's side runs as 2 fresh processes under torchrun's environment
(tests/_accelerate_folder_run.py: the uninterrupted run saving the folder, then Accelerate's
resume from it); mixprec's side runs on the warm ranks of tests/distributed/harness.py. The
assertions (tests/_accelerate_folder_run.py, shared with the single-process test
tests/checkpoint/test_accelerate_folder.py): right after ``load_state`` every restored state
equals Accelerate's on the same rank, bit for bit; then the same batches, random draws,
accumulation boundaries and learning rates; losses and weights held to the float64 rule
against a float64 replay of both ranks' micro-batches with DDP's gradient average.
"""

from __future__ import annotations

import sys

import pytest
import torch
from harness import run_distributed, run_script_ranks

pytest.importorskip("accelerate")

import _accelerate_folder_run as R  # noqa: E402 (tests/ is on sys.path: tests/distributed/conftest.py)


def _accelerate_ddp(folder, out, world: int = 2, timeout: float = 300) -> None:
    run_script_ranks([sys.executable, R.__file__, str(folder), str(out)], world,
                     env={"ACCELERATE_USE_CPU": "true"}, timeout=timeout, what="Accelerate rank")


def test_a_ddp_accelerate_folder_resumes_on_mixprec_ddp_rank_by_rank(tmp_path):
    folder = tmp_path / "step_5"
    _accelerate_ddp(folder, tmp_path / "theirs")
    assert sorted(p.name for p in folder.iterdir()) == [
        "custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
        "random_states_1.pkl", "scheduler.bin"]
    theirs = [torch.load(tmp_path / f"theirs.rank{r}.pt", weights_only=False) for r in range(2)]
    # The ranks saved different RNG states: restoring rank 0's on rank 1 would show.
    assert not torch.equal(theirs[0]["after_load"]["torch_rng"], theirs[1]["after_load"]["torch_rng"])
    ours = run_distributed(R.mixprec_resume_on_rank, 2, args=(str(folder), "ddp"), timeout=180)
    for rank in range(2):
        R.assert_same_state(ours[rank]["after_load"], theirs[rank]["after_load"], where=f"rank {rank}")
    # Each rank read its own share of every global batch.
    assert [x["index"] for x in ours[0]["records"]] != [x["index"] for x in ours[1]["records"]]
    R.assert_continues_as_accelerate(folder, ours, theirs)
