import os
import time

import pytest
import torch
from harness import RankFailedError, run_distributed


def _whoami(state, tag):
    return (state.rank, state.world_size, os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"], tag,
            torch.distributed.get_world_size())


def _raise_on_rank1(state):
    if state.rank == 1:
        raise ValueError("rank one broke on purpose")
    time.sleep(60)  # must be killed by the harness, not waited for


def _hang_on_rank1(state):
    if state.rank == 1:
        time.sleep(600)
    return "done"


def _exit_on_rank0(state):
    if state.rank == 0:
        os._exit(3)
    time.sleep(60)


def _env(state):
    return os.environ.get("MIXPREC_TEST_FLAG")


def test_results_come_back_in_rank_order():
    assert run_distributed(_whoami, 2, args=("x",)) == [(0, 2, "0", "127.0.0.1", "x", 2), (1, 2, "1", "127.0.0.1", "x", 2)]


def test_env_is_passed():
    assert run_distributed(_env, 2, env={"MIXPREC_TEST_FLAG": "on"}) == ["on", "on"]


def test_failing_rank_traceback_reaches_pytest():
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed") as info:
        run_distributed(_raise_on_rank1, 2, timeout=60)
    assert info.value.rank == 1
    assert "ValueError: rank one broke on purpose" in str(info.value)
    assert "_raise_on_rank1" in str(info.value)


def test_hanging_rank_times_out_and_is_named():
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] still running"):
        run_distributed(_hang_on_rank1, 2, timeout=10)


def test_rank_dying_without_traceback_is_named():
    with pytest.raises(RankFailedError, match="rank 0 of 2 died with exit code 3"):
        run_distributed(_exit_on_rank0, 2, timeout=60)


# Warm ranks (tests/distributed/harness.py, [Note: warm ranks]): each call starts as a fresh
# process would, whatever the previous call left behind, and a dead rank's pool is replaced.
_KEPT = []  # keeps an Accelerator alive past its call, as a sloppy test would (ended after it)


def _leave_a_mess(state, with_accelerator):
    import random

    if with_accelerator:
        from mixprec import Accelerator

        acc = Accelerator(backend="ddp", cpu=True, log_policy=False)
        model = acc.prepare(torch.nn.Linear(4, 4))
        if with_accelerator == "kept":
            _KEPT.append((acc, model))
        # "dropped": collected when the call returns, its watchdog thread with it (a thread
        # left running would make the worker dirty and its pool be replaced)
    os.environ["MIXPREC_TEST_LEAK"] = "1"
    os.environ["WORLD_SIZE"] = "7"
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(123)
    random.seed(5)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.set_autocast_enabled("cpu", True)
    return os.getpid()


def _look(state):
    import random

    return (os.environ.get("MIXPREC_TEST_LEAK"), os.environ["WORLD_SIZE"], str(torch.get_default_dtype()),
            torch.get_num_threads(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.distributed.get_world_size(), all(acc._ended for acc, _ in _KEPT), (torch.rand(2).tolist(), random.random()), os.getpid())


def test_warm_ranks_start_each_call_as_fresh_ones():
    # A fresh process seeds its generators at random: compare everything else with one.
    fresh = [r[:-2] for r in run_distributed(_look, 2, fresh=True)]
    before = run_distributed(_look, 2)
    assert [r[:-2] for r in before] == fresh
    for with_accelerator in (False, "kept", "dropped"):
        pids = run_distributed(_leave_a_mess, 2, args=(with_accelerator,))
        assert [r[-1] for r in before] == pids  # the same (warm) processes
        # ... and the same state, random generators included (put back, not reseeded).
        assert run_distributed(_look, 2) == before


def test_a_dead_rank_does_not_reach_the_next_call():
    pids = run_distributed(_leave_a_mess, 2, args=(False,))
    with pytest.raises(RankFailedError, match="rank 0 of 2 died with exit code 3"):
        run_distributed(_exit_on_rank0, 2, timeout=60)
    after = run_distributed(_look, 2)
    assert not set(r[-1] for r in after) & set(pids)  # new processes
    assert after[0][:2] == (None, "2")
