"""``mixprec test``: a short 2-process self-check of the installation.

Two Gloo processes on 127.0.0.1 (:func:`mixprec.distributed.spawn.run_distributed`) train
a tiny MLP for a few SGD steps with ``backend="ddp"`` and ``backend="zero2"`` in bf16, each
rank on its half of every batch. The check passes when

* the fp32 parameters are bitwise identical on both ranks, and
* they agree with a single-process plain-PyTorch reference (bf16 autocast, fp32 weights,
  the whole batch) within ``TOLERANCE`` (max absolute difference): the reference sums the
  batch's gradient in another order than two half-batches averaged across ranks, so equal
  bits are not expected.

Example::

    $ mixprec test
    ddp    ranks agree: yes  max |param - reference| = 1.2e-04 (tolerance 2e-03)  PASS
"""

from __future__ import annotations

import os
import sys

TOLERANCE = 2e-3  # max |param - reference| after the steps, bf16 compute
BACKENDS = ("ddp", "zero2")
_BATCH = 16  # per rank


def _train(state, backend: str, steps: int) -> dict:
    # The check must not pick up this shell's MIXPREC_* settings (they would conflict).
    from .config.resolve import CONFIG_FILE_ENV, ENV_NAMES

    for name in (*ENV_NAMES, CONFIG_FILE_ENV):
        os.environ.pop(name, None)
    import copy

    import torch
    from torch import nn

    from . import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(steps, 2 * _BATCH, 8, generator=g)
    ys = torch.randn(steps, 2 * _BATCH, 4, generator=g)

    acc = Accelerator(backend=backend, mixed_precision="bf16", cpu=True, log_policy=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    mine = slice(state.rank * _BATCH, (state.rank + 1) * _BATCH)
    for step in range(steps):
        loss = nn.functional.mse_loss(model(xs[step, mine]).float(), ys[step, mine])
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    trained = {k: v.detach().float().cpu().clone() for k, v in acc.get_state_dict(model).items()}

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = reference(xs[step])
        nn.functional.mse_loss(out.float(), ys[step]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"params": trained, "reference": {k: v.detach().clone() for k, v in reference.state_dict().items()}}


def check(backend: str, steps: int = 4) -> tuple[bool, str]:
    """Run the check for one backend; ``(passed, one-line report)``."""
    from .distributed.spawn import run_distributed

    r0, r1 = run_distributed(_train, 2, args=(backend, steps), timeout=180)
    agree = all(r0["params"][k].equal(r1["params"][k]) for k in r0["params"])
    diff = max((r0["params"][k] - r0["reference"][k]).abs().max().item() for k in r0["params"])
    ok = agree and diff <= TOLERANCE
    line = (f"{backend:<6} ranks agree: {'yes' if agree else 'NO'}  max |param - reference| = "
            f"{diff:.1e} (tolerance {TOLERANCE:.0e})  {'PASS' if ok else 'FAIL'}")
    return ok, line


def main(steps: int = 4) -> int:
    """``mixprec test``: prints one line per backend and PASS/FAIL; exit code 0 on PASS."""
    if steps < 1:
        print(f"mixprec test: --steps {steps} must be >= 1", file=sys.stderr)
        return 2
    print(f"mixprec test: 2 Gloo processes, tiny MLP, bf16, {steps} SGD steps per backend")
    passed = True
    for backend in BACKENDS:
        try:
            ok, line = check(backend, steps)
        except Exception as e:  # noqa: BLE001 - any failure is a FAIL with its reason
            ok, line = False, f"{backend:<6} FAIL: {type(e).__name__}: {e}"
        passed &= ok
        print(line, flush=True)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1
