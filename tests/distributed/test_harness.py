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
