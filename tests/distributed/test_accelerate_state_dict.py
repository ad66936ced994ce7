"""Issue #36 points 4 and 6 on 2 processes, one harness call for every backend.

Point 4: ``get_state_dict(model)`` on the main process alone works where nothing is gathered
(ddp, zero1/zero2 with fp32-stored parameters: their parameters are the masters), as under
Accelerate; and after ``end_training()`` it works there too, or (zero3/fsdp, zero2 with
bf16-stored parameters: the values live in shards) says that end_training() released what
it needs. Point 6: a ``torch.save`` that is refused (an ungathered zero3/fsdp parameter)
creates no file and leaves an existing one as it was.
"""

from __future__ import annotations

from harness import run_distributed

LOCAL = ["ddp", "zero1", "zero2"]
SHARDED = ["zero3", "fsdp", "zero2-bf16"]


def _cases(state, backends, local, tmp):
    import os

    import torch

    from mixprec import Accelerator, UnshardedParameterError

    out = {}
    for name in backends:
        backend, _, stored = name.partition("-")
        acc = Accelerator(cpu=True, backend=backend, log_policy=False, mixed_precision="bf16",
                          param_dtype=torch.bfloat16 if stored == "bf16" else None)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        for _ in range(2):
            acc.backward(model(torch.randn(3, 4)).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        full = acc.get_state_dict(model)  # every rank: the reference
        r = {"dtypes": sorted({str(v.dtype) for v in full.values()})}
        if acc.is_main_process and name in local:
            try:
                alone = acc.get_state_dict(model)
                r["alone"] = all(torch.equal(alone[k], full[k]) for k in full) and list(alone) == list(full)
            except Exception as e:  # noqa: BLE001 - reported to the test
                r["alone"] = f"{type(e).__name__}: {e}"
        if name in ("zero3", "fsdp"):
            path = os.path.join(tmp, f"{name}-{state.rank}.pt")
            kept = os.path.join(tmp, f"{name}-{state.rank}-kept.pt")
            with open(kept, "wb") as f:
                f.write(b"an earlier good file")
            refused = []
            for obj, target in ((model.state_dict(), path), (model, path), ({"model": model.state_dict()}, kept)):
                try:
                    torch.save(obj, target)
                    refused.append("saved")
                except UnshardedParameterError as e:
                    refused.append(str(e))
            r["refused"] = refused
            r["no_file"] = not os.path.exists(path)
            with open(kept, "rb") as f:
                r["kept"] = f.read() == b"an earlier good file"
            with acc.gathered_parameters(model):  # inside the context the save works
                torch.save(model.state_dict(), path)
            r["saved_inside"] = all(torch.equal(torch.load(path)[k].float(), full[k].float()) for k in full)
        try:
            acc.wait_for_everyone()  # a collective the main process's call above must not unbalance
            r["in_step"] = True
        except Exception as e:  # noqa: BLE001
            r["in_step"] = f"{type(e).__name__}: {e}"
        acc.end_training()
        try:
            after = acc.get_state_dict(model)
            r["after_end"] = all(torch.equal(after[k], full[k]) for k in full)
        except Exception as e:  # noqa: BLE001
            r["after_end"] = f"{type(e).__name__}: {e}"
        out[name] = r
    return out


def test_get_state_dict_alone_and_after_end_training_and_refused_save_writes_nothing(tmp_path):
    results = run_distributed(_cases, 2, args=(LOCAL + SHARDED, LOCAL, str(tmp_path)), timeout=240)
    for rank, r in enumerate(results):
        for name in LOCAL:
            got = r[name]
            assert got["dtypes"] == ["torch.float32"], (name, got)
            assert got["in_step"] is True, (rank, name, got)
            if rank == 0:
                assert got["alone"] is True, (name, got)
            assert got["after_end"] is True, (rank, name, got)
        for name in SHARDED:
            got = r[name]
            assert got["in_step"] is True, (rank, name, got)
            assert got["after_end"].startswith("RuntimeError: get_state_dict() after end_training(): Sequential's full "
                                               "weights are gathered from the"), (rank, name, got)
            assert "call get_state_dict(model)" in got["after_end"] and "before accelerator.end_training()" in got["after_end"]
        for name in ("zero3", "fsdp"):
            got = r[name]
            assert len(got["refused"]) == 3 and all("is not gathered, so torch.save cannot read it" in m
                                                    and "refused before writing: no file was created or changed" in m
                                                    for m in got["refused"]), got["refused"]
            assert got["no_file"] and got["kept"] and got["saved_inside"], got
