"""fp16 on a CPU without fp16 arithmetic ([Note: fp16 GEMMs on a CPU without fp16
arithmetic] in src/mixprec/wrappers/half_gemm.py) on every data-parallel backend: the
widened GEMMs run inside ddp's forward and inside the sharded engines' forward (whose
guarded parameters act as plain tensors there), and the backends train bitwise alike, as
they do with torch's own kernels."""

import pytest
from harness import run_distributed


def _train(state, backend):
    import sys
    from pathlib import Path

    import torch
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_half_gemm import Mixer, _data

    from mixprec import Accelerator
    from mixprec.wrappers.half_gemm import _WidenedGemm

    torch.manual_seed(0)
    model = Mixer(64)
    acc = Accelerator(mixed_precision="fp16", cpu=True, log_policy=False, backend=backend,
                      config={"cpu_fp16_matmul": "fp32"})
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = _data(64, seed=state.rank)
    calls = []
    real = _WidenedGemm.apply
    _WidenedGemm.apply = lambda *a: (calls.append(a[0]), real(*a))[1]
    try:
        for _ in range(2):
            loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            assert opt.step().stepped
            opt.zero_grad()
    finally:
        _WidenedGemm.apply = real
    weights = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    acc.end_training()
    return sorted(set(calls)), weights


def test_every_backend_runs_the_widened_gemms_and_trains_alike():
    import torch

    results = {b: run_distributed(_train, 2, args=(b,)) for b in ("ddp", "zero1", "zero3", "fsdp")}
    for backend, ranks in results.items():
        for kinds, weights in ranks:
            assert kinds == ["addmm", "bmm", "linear", "matmul2"], (backend, kinds)
            ref = results["ddp"][0][1]
            assert weights.keys() == ref.keys()
            for k in ref:
                assert torch.equal(weights[k], ref[k]), (backend, k)
