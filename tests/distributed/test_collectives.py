import datetime

import pytest
import torch
from harness import run_distributed

from mixprec.distributed import (
    DistributedState,
    barrier,
    broadcast,
    broadcast_object_list,
    gather,
    gather_for_metrics,
    gather_object,
    init_distributed,
    pad_across_processes,
    reduce,
    split_between_processes,
)


def _collectives(state):
    r, w = state.rank, state.world_size
    out = {}
    out["gather"] = gather(state, {"a": torch.tensor([[r, r + 10]]), "s": torch.tensor(float(r)), "t": (torch.tensor([r * 2]),)})
    out["gather_object"] = gather_object(state, [f"r{r}"] * (r + 1))
    out["gather_object_scalar"] = gather_object(state, {"rank": r})
    x = torch.tensor([1.0 + r, 2.0 * r])
    out["sum"] = reduce(state, [x, torch.tensor(r)])
    out["mean"] = reduce(state, {"x": x}, reduction="mean")
    out["input_untouched"] = x
    out["broadcast"] = broadcast(state, {"v": torch.full((2,), float(r))}, src=w - 1)
    out["bobj"] = broadcast_object_list(state, [f"from{r}", r], src=1)
    seq = torch.arange(r + 1).reshape(1, r + 1) + 1  # rank r has r + 1 columns
    out["pad"] = pad_across_processes(state, seq, dim=1, pad_index=-1)
    out["pad_first"] = pad_across_processes(state, seq, dim=1, pad_index=-1, pad_first=True)
    out["pad_scalar"] = pad_across_processes(state, torch.tensor(5))
    out["metrics"] = gather_for_metrics(state, torch.tensor([10 * r, 10 * r + 1]), remainder=2 * w - 1)
    out["metrics_all"] = gather_for_metrics(state, torch.tensor([r]), remainder=None)
    with split_between_processes(state, list(range(2 * w + 1))) as mine:
        out["split_list"] = mine
    with split_between_processes(state, {"a": list("abcdefg")[: w + 1], "b": torch.arange(w + 1)}, apply_padding=True) as mine:
        out["split_dict"] = mine
    with split_between_processes(state, torch.arange(w * 2).reshape(w * 2, 1)) as mine:
        out["split_tensor"] = mine
    barrier(state)
    return out


def _check(results, w):
    for r, out in enumerate(results):
        assert torch.equal(out["gather"]["a"], torch.tensor([[k, k + 10] for k in range(w)]))
        assert torch.equal(out["gather"]["s"], torch.arange(w, dtype=torch.float32))
        assert torch.equal(out["gather"]["t"][0], torch.arange(w) * 2)
        assert out["gather_object"] == [f"r{k}" for k in range(w) for _ in range(k + 1)]
        assert out["gather_object_scalar"] == [{"rank": k} for k in range(w)]
        assert torch.equal(out["sum"][0], torch.tensor([w + sum(range(w)), 2.0 * sum(range(w))]))
        assert torch.equal(out["sum"][1], torch.tensor(sum(range(w))))
        assert torch.allclose(out["mean"]["x"], torch.tensor([1 + sum(range(w)) / w, 2.0 * sum(range(w)) / w]))
        assert torch.equal(out["input_untouched"], torch.tensor([1.0 + r, 2.0 * r]))
        assert torch.equal(out["broadcast"]["v"], torch.full((2,), float(w - 1)))
        assert out["bobj"] == ["from1", 1]
        expect = [k + 1 for k in range(r + 1)] + [-1] * (w - r - 1)
        assert out["pad"].tolist() == [expect]
        assert out["pad_first"].tolist() == [[-1] * (w - r - 1) + [k + 1 for k in range(r + 1)]]
        assert out["pad_scalar"].item() == 5
        assert out["metrics"].tolist() == [v for k in range(w) for v in (10 * k, 10 * k + 1)][: 2 * w - 1]
        assert out["metrics_all"].tolist() == list(range(w))
        assert torch.equal(out["split_tensor"], torch.tensor([[2 * r], [2 * r + 1]]))
    # 2w+1 items: rank 0 gets 3, the others 2, contiguous and in order
    assert [x for out in results for x in out["split_list"]] == list(range(2 * w + 1))
    assert len(results[0]["split_list"]) == 3 and all(len(o["split_list"]) == 2 for o in results[1:])
    # w+1 items padded: every share has 2 items; the padded ones repeat their last item
    assert all(len(o["split_dict"]["a"]) == 2 and len(o["split_dict"]["b"]) == 2 for o in results)
    assert results[0]["split_dict"]["a"] == ["a", "b"] and results[0]["split_dict"]["b"].tolist() == [0, 1]
    assert results[1]["split_dict"]["a"] == ["c", "c"] and results[1]["split_dict"]["b"].tolist() == [2, 2]


def test_collectives_two_ranks():
    _check(run_distributed(_collectives, 2), 2)


def test_collectives_four_ranks():
    _check(run_distributed(_collectives, 4), 4)


def test_single_process_is_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    state = init_distributed(torch.device("cpu"))
    assert state == DistributedState() and state.is_main_process and state.num_processes == 1 and state.group is None
    t = torch.tensor([1.0, 2.0])
    assert gather(state, {"t": t})["t"] is t
    assert gather(state, torch.tensor(3.0)).shape == (1,)
    assert torch.equal(reduce(state, t, reduction="mean"), t)
    assert broadcast(state, t) is t
    assert gather_object(state, ["a"]) == ["a"] and gather_object(state, 7) == [7]
    assert gather_for_metrics(state, torch.arange(4), remainder=3).tolist() == [0, 1, 2]
    with split_between_processes(state, [1, 2, 3]) as mine:
        assert mine == [1, 2, 3]
    barrier(state)


def test_state_is_frozen_keyword_only():
    with pytest.raises(TypeError):
        DistributedState(0, 2)  # noqa
    state = DistributedState(rank=1, world_size=2, local_rank=1, local_world_size=2)
    assert not state.is_main_process and not state.is_local_main_process
    with pytest.raises(AttributeError):
        state.rank = 0


@pytest.mark.parametrize(
    "env, match",
    [
        ({"WORLD_SIZE": "2"}, "RANK is not set"),
        ({"WORLD_SIZE": "two"}, r"WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, r"RANK=2 must be < WORLD_SIZE=2"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR is not set"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "p"}, r"MASTER_PORT='p'"),
    ],
)
def test_bad_environment_names_the_variable(monkeypatch, env, match):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        init_distributed(torch.device("cpu"), timeout=datetime.timedelta(seconds=5))


def test_bad_arguments_echo_the_value():
    state = DistributedState()
    with pytest.raises(ValueError, match="reduction='prod'"):
        reduce(state, torch.ones(1), reduction="prod")
    with pytest.raises(TypeError, match="no tensors"):
        gather(state, {"a": 1})
    with pytest.raises(ValueError, match="src=3"):
        broadcast(state, torch.ones(1), src=3)
    with pytest.raises(ValueError, match="remainder=-1"):
        gather_for_metrics(state, torch.ones(1), remainder=-1)
