"""The Accelerator facade across processes: backend choice, data sharding, metrics gathering."""

from harness import run_distributed


def _facade(state):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from mixprec import Accelerator

    acc = Accelerator(cpu=True, log_policy=False, data_seed=7)
    dataset = TensorDataset(torch.arange(13).float())  # 13 samples, batch 2, 2 ranks: uneven
    model = torch.nn.Linear(1, 1)
    model, loader = acc.prepare(model, DataLoader(dataset, batch_size=2, shuffle=True))
    seen = []
    for (x,) in loader:
        seen.append(acc.gather_for_metrics(x))
    epoch0 = torch.cat(seen).tolist()
    loader.set_epoch(1)
    epoch1 = torch.cat([acc.gather_for_metrics(x) for (x,) in loader]).tolist()
    objects = acc.gather_for_metrics([f"r{acc.process_index}"], use_gather_object=True)
    with acc.split_between_processes(list(range(5))) as mine:
        share = mine
    return {
        "backend": acc.backend, "index": acc.process_index, "n": acc.num_processes,
        "main": acc.is_main_process, "epoch0": epoch0, "epoch1": epoch1, "objects": objects,
        "share": share, "sum": acc.reduce(torch.tensor(float(acc.process_index + 1))).item(),
    }


def test_facade_on_two_processes():
    r0, r1 = run_distributed(_facade, 2)
    assert (r0["backend"], r0["index"], r0["n"], r0["main"]) == ("ddp", 0, 2, True)
    assert (r1["index"], r1["main"]) == (1, False)
    # Every sample exactly once, duplicates of even batching dropped, same on both ranks.
    assert sorted(r0["epoch0"]) == [float(i) for i in range(13)]
    assert r0["epoch0"] == r1["epoch0"]
    assert sorted(r0["epoch1"]) == sorted(r0["epoch0"]) and r0["epoch1"] != r0["epoch0"]
    assert r0["objects"] == ["r0", "r1"]
    assert r0["share"] + r1["share"] == [0, 1, 2, 3, 4]
    assert r0["sum"] == r1["sum"] == 3.0


def _single_backend_refused(state):
    from mixprec import Accelerator

    try:
        Accelerator(backend="single", cpu=True)
    except ValueError as e:
        return str(e)
    return None


def test_single_backend_with_several_processes_is_refused():
    for message in run_distributed(_single_backend_refused, 2):
        assert message and "backend='single' runs one process but WORLD_SIZE=2" in message


def _stray_backward_before_prepare(state):
    """Issue 29, point 1 on the sharded path: a stray backward before prepare() on zero2 (and
    ddp) leaves the run bitwise equal to the clean one (the gradients are cleared)."""
    import warnings

    import torch

    from mixprec import Accelerator, StaleGradientsWarning

    out = {}
    for backend in ("ddp", "zero2"):
        finals = []
        for stray in (False, True):
            acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False)
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 3)
            g = torch.Generator().manual_seed(10 + state.rank)
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)
            if stray:
                (1000 * torch.nn.functional.mse_loss(model(x), y)).backward()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model, opt = acc.prepare(model, opt)
            warned = [w for w in caught if issubclass(w.category, StaleGradientsWarning)]
            assert len(warned) == (1 if stray else 0), [str(w.message) for w in caught]
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            finals.append([t.detach().clone() for t in acc.get_state_dict(model).values()])
        out[backend] = all(torch.equal(a, b) for a, b in zip(*finals))
    return out


def test_stray_backward_before_prepare_does_not_reach_ddp_or_zero2():
    assert run_distributed(_stray_backward_before_prepare, 2) == [{"ddp": True, "zero2": True}] * 2


def _startup_lines(state):
    import contextlib
    import io

    import torch

    from mixprec import Accelerator

    lines = {}
    for backend in ("auto", "zero3"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            acc = Accelerator(mixed_precision="bf16", backend=None if backend == "auto" else backend, cpu=True)
            acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
        lines[backend] = (buf.getvalue(), repr(acc.state))
    return lines


def test_startup_line_on_two_processes():
    """Issue 29, point 5: the main process prints one line naming how `auto` resolved (ddp),
    world size, nodes, process group, policy and buckets/units; rank 1 prints nothing."""
    r0, r1 = run_distributed(_startup_lines, 2)
    auto, auto_state = r0["auto"]
    assert auto.count("\n") == 1 and auto.startswith(
        "mixprec: backend ddp (auto: WORLD_SIZE=2); world size 2 (1 node x 2 processes); process group gloo; "
        "mixprec policy: mixed_precision='bf16'"), auto
    assert auto.rstrip().endswith("; Sequential: 1 gradient bucket(s) (cap 25 MB, first 1 MB)")
    zero3, zero3_state = r0["zero3"]
    assert zero3.startswith("mixprec: backend zero3 (from argument backend=); world size 2"), zero3
    assert zero3.rstrip().endswith("; Sequential: 1 sharding unit(s)")
    assert "Backend: ddp\nProcess group backend: gloo\n" in auto_state
    assert "Backend: zero3\n" in zero3_state
    assert r1["auto"][0] == r1["zero3"][0] == ""
