"""``torch.compile`` of a prepared model under tensor parallelism and under TP x SP (issue #35
deliver point 4): the compiled forward and backward train like eager.

The split modules' collectives run in forward hooks marked ``torch.compiler.disable``
([Note: split modules keep their forward] in src/mixprec/parallel/tensor/layers.py): Dynamo
breaks the graph around each and runs it eagerly, and compiles the module code between them;
Ulysses' all-to-alls are traced into the graph ([Note: Ulysses under torch.compile] in
src/mixprec/parallel/sequence/ulysses.py). Each case trains the tiny Llama of the model matrix
2 AdamW steps eagerly and compiled (the backends ``aot_eager`` and ``inductor``), fp32, ddp:
the losses agree to 1e-6 and the weights to 1e-5 of their largest value (inductor fuses
elementwise chains into other roundings; measured 4e-8 loss, 3e-6 weights).
"""

import pytest

from harness import run_distributed


def _compiled(state, backends, tp, sp):
    import torch

    import test_model_matrix as t
    import test_tp_sp as s

    out = {}
    for backend in [None, *backends]:
        acc = s._accelerator("ddp", tp, sp)
        model = t._build("llama")
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        forward = model if backend is None else torch.compile(model, backend=backend)
        losses = []
        for step in range(2):
            ids = t._batch(step)
            batch = acc.prepare_sp_inputs(input_ids=ids, labels=ids)
            loss = forward(**batch).loss
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[str(backend)] = (losses, {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()})
        acc.end_training()
        torch._dynamo.reset()
    eager_losses, eager = out["None"]
    return {b: (max(abs(x - y) / abs(y) for x, y in zip(out[b][0], eager_losses)),
                max(float((out[b][1][k] - eager[k]).abs().max() / eager[k].abs().max().clamp_min(1e-30))
                    for k in eager))
            for b in backends}


@pytest.mark.parametrize("tp,sp,world,backends", [
    (2, 1, 2, ("aot_eager",)),
    (2, 2, 4, ("aot_eager",)),
    # inductor compiles C++ for half a minute: with the whole model matrix (`make test-matrix`, CI)
    pytest.param(2, 1, 2, ("inductor",), marks=pytest.mark.matrix),
])
def test_compiled_forward_and_backward_equal_eager(tp, sp, world, backends):
    pytest.importorskip("transformers")
    for rank, r in enumerate(run_distributed(_compiled, world, args=(backends, tp, sp), timeout=900)):
        for backend, (loss, weights) in r.items():
            assert loss <= 1e-6 and weights <= 1e-5, (rank, backend, loss, weights)
