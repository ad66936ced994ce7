"""The suite's judge of fp32 results (tests/_numerics.py, [Note: calibrated bounds]) judges:
an fp32 run that sums in another order passes, a 0.1% error planted in any one tensor fails
(the analytic negative control agrees with judging each planted copy), a missed step fails,
and a spread too wide to see 0.1% in a scalar refuses to judge."""

import pytest
import torch

from _helpers import make_mlp, mlp_batches
from _numerics import PLANTED, Judge, judge_runs, reference_run, scalar_excess


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.fixture(scope="module")
def runs():
    batches = mlp_batches(6)
    judge, ref64, spread = judge_runs(make_mlp, batches, loss=_loss, lr=1e-2, eps=1e-6, clip=1.0)
    return judge, ref64, spread, batches


def test_an_fp32_run_in_another_order_passes(runs):
    judge, _, spread, _ = runs
    for run in spread:
        v = judge.verdict(run["state"])
        assert v["excess"] <= 1.0 and not v["escapes"], v


def test_a_planted_error_in_any_one_tensor_fails_and_the_control_agrees(runs):
    judge, _, spread, _ = runs
    got = spread[1]["state"]
    assert judge.planted_escapes(got) == []  # the analytic control, as every verdict runs it
    # A spread as wide as the planted error: now the control must report escapes.
    wide = Judge(judge.ref64, [{k: v * (1 + 10 * PLANTED) for k, v in got.items()}], judge.keys)
    assert wide.planted_escapes(got) == wide.judged
    for key in judge.judged:
        planted = dict(got, **{key: got[key] * (1 + PLANTED)})
        assert judge.excess(planted)[0] > 1.0, key


def test_a_missed_step_fails(runs):
    judge, _, _, batches = runs
    short = reference_run(make_mlp, batches[:-1], "f32", loss=_loss, lr=1e-2, eps=1e-6, clip=1.0)
    assert judge.excess(short["state"])[0] > 10.0


def test_zero_initialised_tensors_count_in_the_norm_only():
    ref = {"w": torch.ones(4), "b": torch.zeros(4)}
    spread = [{"w": torch.ones(4) * (1 + 1e-7), "b": torch.full((4,), 1e-7)}]
    judge = Judge(ref, spread, zero={"b"})
    assert judge.judged == ["w"]
    assert judge.excess({"w": torch.ones(4), "b": torch.full((4,), 5e-7)})[0] > 1.0  # the norm sees it


def test_scalars_pass_within_the_spread_and_refuse_a_spread_too_wide():
    ref = [1.0, 2.0]
    assert scalar_excess([1.0 + 1e-7, 2.0], ref, [[1.0 + 2e-7, 2.0]]) <= 1.0
    assert scalar_excess([1.001, 2.0], ref, [[1.0 + 2e-7, 2.0]]) > 1.0
    with pytest.raises(AssertionError, match="0.1% error"):
        scalar_excess([1.0, 2.0], ref, [[1.01, 2.0]])
