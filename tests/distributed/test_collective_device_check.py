"""Every collective mixprec issues gets its tensors on its group's device (issue #37 point 2).

A CPU run over Gloo cannot fail the way an NCCL run does when a host tensor reaches a
collective; tests/distributed/device_check.py makes it see that ([Note: host-born tensors]):
every ``torch.distributed`` / functional / ``_C.broadcast_coalesced`` call is checked, with
host-born tensors told apart from device ones. Each backend (ddp, zero1, zero2, zero3, fsdp)
runs the tiny Llama of the model matrix under TP=2 and under SP=2 (2 processes) through
prepare (TP's random-state sync, the structure check, the replica checks), two optimizer
steps of two accumulated micro-batches with a clip that engages, ``gather_for_metrics`` (of
the model's predictions and of a host tensor a user made), ``reduce``, ``pad_across_processes``
of a host tensor, ``wait_for_everyone``, ``gathered_parameters(modifier_rank=0)`` (zero3/fsdp
without TP), ``save_state`` / ``load_state`` and ``get_state_dict``; a TP=2 x SP=2 pass on 4 processes runs zero3.
"""

import pytest

from harness import run_distributed

BACKENDS = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def _case(backend: str, tp: int, sp: int, save_dir: str) -> dict:
    import torch

    import test_model_matrix as t
    from device_check import checking
    from mixprec import Accelerator

    with checking() as check:
        cfg = {"tensor_parallel": {"size": tp}, "sequence_parallel": {"size": sp}}
        acc = Accelerator(cpu=True, log_policy=False, backend=backend, config=cfg, gradient_accumulation_steps=2)
        model = t._build("llama")
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        mesh = acc.mesh
        dp, r = (mesh.dp_size, mesh.dp_rank) if mesh is not None else (acc.num_processes, acc.process_index)
        norms = []
        for step in range(2):
            ids = t._batch(step).to(acc.device)
            ids = ids[r * (len(ids) // dp):(r + 1) * (len(ids) // dp)]
            half = len(ids) // 2
            for part in (ids[:half], ids[half:]):
                with acc.accumulate(model):
                    batch = acc.prepare_sp_inputs(input_ids=part, labels=part)
                    out = model(**batch)
                    acc.backward(out.loss)
                    if acc.sync_gradients:
                        norms.append(float(acc.clip_grad_norm_(model.parameters(), 1e-3)))
                    opt.step()
                    opt.zero_grad()
        preds = acc.gather_for_metrics(out.logits.argmax(-1))
        host = acc.gather(torch.tensor([acc.process_index, 7]))  # a host tensor a user made
        mean = acc.reduce(out.loss.detach(), "mean")
        padded = acc.pad_across_processes(torch.ones(acc.process_index + 1, 2), dim=0)  # host, uneven
        acc.wait_for_everyone()
        if backend in ("zero3", "fsdp") and tp == 1:
            with acc.gathered_parameters(model, modifier_rank=0):  # rank 0's edits broadcast on exit
                pass
        acc.save_state(save_dir)
        acc.load_state(save_dir)
        state = acc.get_state_dict(model)
        acc.end_training()
    return {"violations": check.report(), "sites": sorted({c.site for c in check.calls}),
            "count": len(check.calls), "norms": norms, "preds": tuple(preds.shape),
            "host": host.tolist(), "host_device": str(host.device), "mean": float(mean),
            "keys": len(state), "padded": tuple(padded.shape)}


def _cases(state, cases, tmp):
    import os

    out = {}
    for backend, tp, sp in cases:  # end_training() ends the process group; the next Accelerator starts one
        out[(backend, tp, sp)] = _case(backend, tp, sp, os.path.join(tmp, f"{backend}-tp{tp}-sp{sp}"))
    return out


def _check(results, world):
    for case, got in results.items():
        assert got["violations"] == "", f"{case}: collectives handed host tensors:\n{got['violations']}"
        assert got["count"] > 20, (case, got["count"])  # the checker saw the run's collectives
        assert len(got["norms"]) == 2 and all(n > 1e-3 for n in got["norms"]), (case, got["norms"])  # clip engaged
        assert got["host"] == [v for r in range(world) for v in (r, 7)], (case, got["host"])
        assert got["host_device"] == "cpu"  # back where the user's tensor was
        assert got["keys"] > 0
        assert got["padded"] == (world, 2)
        backend, tp, sp = case
        if tp > 1:  # the TP random-state sync ran under the check (the old one broadcast a host tensor)
            assert any("_sync_rng" in s for s in got["sites"]), got["sites"]
        if sp > 1:
            assert any("ulysses.py" in s for s in got["sites"]), got["sites"]
        if backend in ("zero3", "fsdp"):
            assert any("units.py" in s for s in got["sites"]), got["sites"]


@pytest.mark.parametrize("layout", ["tp2", "sp2"])
def test_every_collective_gets_its_tensors_on_the_group_device(layout, tmp_path):
    tp, sp = (2, 1) if layout == "tp2" else (1, 2)
    cases = [(b, tp, sp) for b in BACKENDS]
    got = run_distributed(_cases, 2, args=(cases, str(tmp_path)), timeout=600)
    for rank in got:
        _check(rank, world=2)


@pytest.mark.slow
def test_tp2_sp2_collectives_on_the_group_device(tmp_path):
    got = run_distributed(_cases, 4, args=([("zero3", 2, 2)], str(tmp_path)), timeout=600)
    for rank in got:
        _check(rank, world=4)


def test_the_checker_sees_a_host_tensor_on_a_collective():
    """The seam itself: a host-born tensor (the old TP random-state sync broadcast
    ``torch.get_rng_state()`` as it was) is reported; the same tensor moved with
    ``.to(group_device)`` is not; a factory given the device is not."""
    import torch
    import torch.distributed as dist

    from device_check import checking
    from mixprec.distributed.devices import group_device

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with checking() as check:
            dist.broadcast(torch.get_rng_state(), src=0)
            dist.broadcast(torch.get_rng_state().to(group_device(None)), src=0)
            flag = torch.zeros(1)
            dist.all_reduce(flag)
            dist.all_reduce(torch.zeros(1, device=group_device(None)))
            dist.all_reduce(flag.double().sum().reshape(1))  # ops on a host tensor stay host
            dist.all_reduce(torch.ones(3).to(group_device(None)) * flag)  # a device op with a host operand
            params = torch.nn.Linear(2, 2)  # made on the default device
            dist.broadcast(params.weight.detach(), src=0)
            params.to(group_device(None))
            dist.broadcast(params.weight.detach(), src=0)
        bad = [(c.name, bool(c.problems)) for c in check.calls]
    finally:
        dist.destroy_process_group()
    assert bad == [("broadcast", True), ("broadcast", False), ("all_reduce", True), ("all_reduce", False),
                   ("all_reduce", True), ("all_reduce", False), ("broadcast", True), ("broadcast", False)]
