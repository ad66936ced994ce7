"""The unit order check once per forward ([Note: batched unit order check] in
src/mixprec/engines/units.py), on 2 processes over Gloo: a fixed order costs one exchange per
forward after two; an order that changes on every rank together keeps training (the same
weights as ddp), re-checked per gather until it is the same two forwards in a row; a rank that skips units once the
order is established is named on every rank at the end of that forward, before its backward;
the deferred (NCCL) form names a difference one forward later."""

import pytest

from harness import run_distributed

BLOCKS = 6


def _net():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    class Net(nn.Module):
        def __init__(self, d: int = 8) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(d) for _ in range(BLOCKS))
            self.head = nn.Linear(d, 1)

        def forward(self, x, skip=()):
            for i, block in enumerate(self.blocks):
                if i not in skip:
                    x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _train(state, backend, skips, options=None):
    """``skips[rank][step]``: the blocks this rank skips at that step. Returns, per step, the
    check's exchanges in that step's forward, where a UnitOrderError was raised (and its
    message), and the final weights."""
    import torch

    from mixprec import Accelerator
    from mixprec.engines import units
    from mixprec.errors import UnitOrderError

    sharded = backend in ("zero3", "fsdp")
    opts = {"units": ["Block"], **(options or {})} if sharded else {"find_unused_parameters": True}
    acc = Accelerator(backend=backend, cpu=True, log_policy=False, engine_options=opts)
    model = _net()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # The check's collectives: every all-gather units.py issues (the parameter gathers run in C++).
    calls, original = [0], units._all_gather

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    units._all_gather = counting
    out = {"exchanges": [], "error": None}
    rank_skips = skips[state.rank]
    for step in range(len(rank_skips)):
        g = torch.Generator().manual_seed(10 * step + state.rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        before = calls[0]
        phase = "forward"
        try:
            loss = torch.nn.functional.mse_loss(model(x, skip=rank_skips[step]), y)
            out["exchanges"].append(calls[0] - before)
            phase = "backward"
            acc.backward(loss)
            phase = "step"
            opt.step()
            opt.zero_grad()
        except UnitOrderError as error:
            out["error"] = {"step": step, "phase": phase, "message": str(error), "theirs": error.theirs}
            units._all_gather = original
            return out
    units._all_gather = original
    out["weights"] = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    acc.end_training()
    return out


def test_a_fixed_order_is_exchanged_once_per_forward_after_two_forwards():
    skips = [[()] * 5] * 2
    got = run_distributed(_train, 2, args=("zero3", skips), timeout=180)
    for rank in got:
        assert rank["error"] is None, rank["error"]
        per_gather = rank["exchanges"][:2]
        # forwards 1 and 2: an exchange before each of the 7 units' gathers, plus the forward's
        assert all(n >= BLOCKS + 1 for n in per_gather), rank["exchanges"]
        assert rank["exchanges"][2:] == [1, 1, 1], rank["exchanges"]  # the order is established


def test_every_gather_mode_keeps_the_exchange_before_each_gather():
    skips = [[()] * 4] * 2
    got = run_distributed(_train, 2, args=("fsdp", skips, {"check_unit_order": "every_gather"}), timeout=180)
    for rank in got:
        assert rank["error"] is None and all(n >= BLOCKS + 1 for n in rank["exchanges"]), rank


def test_an_order_every_rank_changes_together_trains_like_ddp():
    # Step 3 skips block 2 on both ranks: a changed order, agreed; the next two forwards are
    # checked per gather again (the order changed, then changed back), then once per forward.
    schedule = [(), (), (), (2,), (), (), ()]
    got = run_distributed(_train, 2, args=("zero3", [schedule] * 2), timeout=180)
    ref = run_distributed(_train, 2, args=("ddp", [schedule] * 2), timeout=180)[0]
    for rank in got:
        assert rank["error"] is None, rank["error"]
        ex = rank["exchanges"]
        assert ex[2] == 1 and ex[3] == 1 and ex[4] > 1 and ex[5] > 1 and ex[6] == 1, ex
        for key, value in ref["weights"].items():  # fp32, 2 ranks: the same sums as ddp's
            assert torch_equal(rank["weights"][key], value), key


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize("skipped", [(2,), (2, 3)])
def test_a_rank_skipping_units_is_named_at_the_end_of_the_forward_before_backward(skipped):
    # Rank 1 skips blocks at step 3, once the order is established (batched check): its
    # gathers stay paired with rank 0's (the skipped units are gathered in order), so the
    # forward reaches its check, which both ranks fail the same way.
    skips = [[()] * 5, [(), (), (), skipped, ()]]
    got = run_distributed(_train, 2, args=("zero3", skips), timeout=180)
    after = f"blocks.{skipped[-1] + 1}"
    for rank, result in enumerate(got):
        error = result["error"]
        assert error is not None and error["step"] == 3 and error["phase"] == "forward", result
        assert error["theirs"] == {0: "blocks.2", 1: after}, error
        assert f"rank 0: 'blocks.2', rank 1: '{after}'" in error["message"], error["message"]
        assert "before its backward" in error["message"] and "leaf_module_classes" in error["message"]
        assert result["exchanges"] == [8, 8, 1], result["exchanges"]


def _drive_deferred(state, sequences):
    """The per-forward check alone, deferred (what NCCL gets), over Gloo."""
    import torch.distributed as dist

    from mixprec.engines.units import UnitOrderCheck
    from mixprec.errors import UnitOrderError

    names = [f"blocks.{i}" for i in range(4)] + ["<root>"]
    check = UnitOrderCheck(dist.group.WORLD, names, deferred=True)
    assert check.per_unit is False  # deferred: the per-forward exchange only
    for forward, sequence in enumerate(sequences[state.rank], start=1):
        check.begin_forward()
        for index in sequence:
            check.record(index)
            check.before_gather(index)  # no exchange inside a forward
        try:
            check.end_forward()
        except UnitOrderError as error:
            return {"raised_at": forward, "message": str(error), "exchanges": check.exchanges}
    return {"raised_at": None, "exchanges": check.exchanges}


def test_deferred_per_forward_check_names_the_difference_one_forward_later():
    same = [4, 0, 1, 2, 3]
    other = [4, 0, 2, 1, 3]
    got = run_distributed(_drive_deferred, 2, args=([[same] * 4, [same, other, same, same]],), timeout=120)
    for result in got:
        assert result["raised_at"] == 3, result  # forward 2 differed, read at the end of forward 3
        assert result["exchanges"] == 3
        assert "rank 0: 'blocks.1', rank 1: 'blocks.2'" in result["message"], result["message"]
        assert "forward 2 differed, found at the end of forward 3" in result["message"]
    quiet = run_distributed(_drive_deferred, 2, args=([[same] * 4] * 2,), timeout=120)
    assert [r["raised_at"] for r in quiet] == [None, None]
