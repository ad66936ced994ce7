"""The unit order check's deferred mode ([Note: deferred unit order check] in
src/mixprec/engines/units.py), which NCCL uses so that the check reads nothing on the host
per unit: forced on over Gloo here, on two real processes."""

import pytest

from harness import run_distributed

NAMES = ["blocks.0", "blocks.1", "blocks.2", "<root>"]


def _drive(state, orders, deferred, lag):
    """Call the check with this rank's sequence of unit indices; report where it raised."""
    import torch.distributed as dist

    from mixprec.diagnostics.syncs import ScalarReads
    from mixprec.engines.units import UnitOrderCheck
    from mixprec.errors import UnitOrderError

    check = UnitOrderCheck(dist.group.WORLD, NAMES, deferred=deferred, lag=lag)
    calls = 0
    with ScalarReads() as reads:
        try:
            for index in orders[state.rank]:
                calls += 1
                check(index)
        except UnitOrderError as error:
            return {"raised_at": calls, "message": str(error), "mine": error.mine if hasattr(error, "mine") else None,
                    "deferred": check.deferred, "reads": reads.count}
    return {"raised_at": None, "deferred": check.deferred, "reads": reads.count}


def test_deferred_check_raises_later_on_every_rank_at_the_same_call():
    # rank 0 gathers 0,1,... rank 1 gathers 1,0,...: the first call already differs
    forward0 = [3, 0, 1, 2]
    forward1 = [3, 1, 0, 2]
    orders = [forward0 * 4, forward1 * 4]
    got = run_distributed(_drive, 2, args=(orders, True, 4), timeout=120)
    for rank, result in enumerate(got):
        assert result["deferred"] is True
        # the difference is at call 2; the snapshot taken at call 4 is read at call 8
        assert result["raised_at"] == 8, result
        assert "rank 0: 'blocks.0', rank 1: 'blocks.1'" in result["message"], result["message"]
        assert f"this rank ({rank}) wanted 'blocks.{rank}'" in result["message"]
        assert "deferred check" in result["message"] and "leaf_module_classes" in result["message"]
        assert result["reads"] == 0  # nothing read from the (here CPU) buffers through the dispatcher


def test_deferred_check_stays_quiet_when_the_orders_agree():
    order = [3, 0, 1, 2] * 5
    got = run_distributed(_drive, 2, args=([order, order], True, 4), timeout=120)
    assert [r["raised_at"] for r in got] == [None, None]


def test_gloo_default_is_the_immediate_check():
    orders = [[3, 0, 1], [3, 1, 0]]
    got = run_distributed(_drive, 2, args=(orders, None, None), timeout=120)
    for result in got:
        assert result["deferred"] is False
        assert result["raised_at"] == 2, result  # at the first differing call
        assert "deferred" not in result["message"]


def test_lag_must_be_a_positive_int():
    import torch.distributed as dist

    from mixprec.engines.units import UnitOrderCheck

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"lag=0 must be an int >= 1"):
            UnitOrderCheck(dist.group.WORLD, NAMES, deferred=True, lag=0)
        check = UnitOrderCheck(dist.group.WORLD, NAMES, deferred=True)
        assert check.lag == len(NAMES)
        for i in [3, 0, 1, 2] * 3:  # one rank always agrees with itself
            check(i)
    finally:
        dist.destroy_process_group()
