"""Checkpoints across processes: ddp resume, cross-backend resharding, crashes, lone callers.

Adding a backend to the cross-backend matrix is one entry in ``WORLD`` (its world size)
plus the pairs in the parametrize list.
"""

import os
import sys
import time

import pytest
import torch

from harness import RankFailedError, run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "checkpoint"))

from ckpt_training import setup, train  # noqa: E402

WORLD = {"single": 1, "ddp": 2, "zero1": 2, "zero2": 2, "zero3": 4, "fsdp": 2}  # backend -> world size


def _run(backend, *args, **kw):
    """``train`` on ``backend``: in this process for single, else on spawned ranks.
    Returns one (losses, state, scale) per rank."""
    if WORLD[backend] == 1:
        return [train(*args, **kw)]
    return run_distributed(_train_rank_kw, WORLD[backend], args=(args, {**kw, "backend": backend}))


def _train_rank_kw(state, args, kw):
    return train(*args, **kw)


@pytest.mark.parametrize("backend", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_resume_is_bitwise(tmp_path, mixed_precision, backend):
    ck = str(tmp_path / "c5")
    full = _run(backend, mixed_precision, 10, save_at=5, save_dir=ck)
    resumed = _run(backend, mixed_precision, 10, load_dir=ck)
    for (f_losses, f_state, _), (r_losses, r_state, _) in zip(full, resumed):
        assert r_losses == f_losses[5:]
        for k in f_state:
            assert torch.equal(f_state[k], r_state[k]), k


def _mean_losses(runs):
    return [sum(r[0][i] for r in runs) / len(runs) for i in range(len(runs[0][0]))]


@pytest.mark.parametrize(
    "source,target",
    [("single", "ddp"), ("ddp", "single"), ("single", "zero2"), ("zero2", "ddp"), ("zero1", "single"),
     ("zero3", "ddp"), ("fsdp", "single"), ("single", "fsdp")],
)
def test_cross_backend_resume(tmp_path, source, target):
    # Same global batches on both sides: no shuffle, no dropout, split_batches on ddp.
    kw = dict(shuffle=False, dropout=0.0, split_batches=True)
    ck = str(tmp_path / "c5")
    full = _mean_losses(_run(source, "no", 10, save_at=5, save_dir=ck, **kw))
    resumed = _mean_losses(_run(target, "no", 10, load_dir=ck, **kw))
    assert len(resumed) == 5
    for a, b in zip(full[5:], resumed):
        assert abs(a - b) <= 1e-5 * abs(a), (full[5:], resumed)


def _killed_during_save(state, project_dir):
    from mixprec.checkpoint.writer import KILL_ENV

    acc, model, opt, loader, sched, counter = setup("bf16", project_dir=project_dir)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
    opt.step()
    acc.save_state()  # checkpoint_0: complete
    good = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    torch.save(good, os.path.join(project_dir, f"good{state.rank}.pt"))
    acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
    opt.step()
    os.environ[KILL_ENV] = "1"  # rank 1 SIGKILLs itself half-way through its tensor file
    acc.save_state()  # checkpoint_1: never completes
    return "not reached"


def test_rank_killed_during_save_leaves_previous_checkpoint(tmp_path):
    from mixprec.checkpoint import CheckpointError, CheckpointReader, list_checkpoints

    with pytest.raises(RankFailedError) as info:
        run_distributed(_killed_during_save, 2, args=(str(tmp_path),), timeout=60)
    # Either rank 1's death is seen first, or rank 0's collective fails on the lost peer.
    assert info.value.rank == 1 and "died" in str(info.value) or "Connection closed by peer" in str(info.value) \
        or "gloo" in str(info.value).lower(), str(info.value)
    folder = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(folder)] == ["checkpoint_0"]
    partial = [p for p in folder.iterdir() if p.name.startswith(".checkpoint_1.tmp-")]
    assert len(partial) == 1
    with pytest.raises(CheckpointError, match="incomplete"):
        CheckpointReader(partial[0])
    # The previous checkpoint still loads (here on one process: resharded from ddp@2).
    acc, model, *_ = setup("bf16", project_dir=tmp_path)
    assert acc.load_state().endswith("checkpoint_0")
    good = torch.load(tmp_path / "good0.pt")
    for k, v in acc.get_state_dict(model).items():
        assert torch.equal(v, good[k]), k


def _lone_caller(state, ck, other_call):
    from mixprec.checkpoint import CollectiveMismatchError, ProjectConfiguration
    from mixprec import Accelerator

    acc = Accelerator(cpu=True, log_policy=False, project_config=ProjectConfiguration(collective_timeout_s=3))
    model = torch.nn.Linear(4, 4)
    acc.prepare(model)
    start = time.monotonic()
    try:
        if state.rank == 0:
            acc.save_state(ck)
        elif other_call == "load_state":
            acc.load_state(ck)
        else:
            time.sleep(8)  # does not call save_state; rank 0 must not hang
            return None
    except CollectiveMismatchError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_save_state_on_one_rank_raises_instead_of_hanging(tmp_path):
    (msg, elapsed), other = run_distributed(_lone_caller, 2, args=(str(tmp_path / "c"), "nothing"), timeout=60)
    assert "save_state() is collective" in msg and "rank(s) [1]" in msg, msg
    assert elapsed < 10
    assert other is None
    assert not (tmp_path / "c").exists()


def test_different_calls_raise_on_every_rank(tmp_path):
    results = run_distributed(_lone_caller, 2, args=(str(tmp_path / "c"), "load_state"), timeout=60)
    for msg, elapsed in results:
        assert "different collective calls" in msg and "save_state" in msg and "load_state" in msg, msg
        assert elapsed < 10
