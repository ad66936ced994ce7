"""Tensor and sequence parallelism together on one ``(dp, sp, tp)`` mesh (issue #35 deliver
point 3; [Note: the rank mesh] in src/mixprec/parallel/mesh.py): TP=2 x SP=2 on 4 processes.

One pass of the 4 warm ranks runs every case on the tiny Llama of the model matrix
(tests/distributed/tiny_models.py: 4 query heads, 2 key/value heads; each rank holds 2 query
heads by TP and runs 1 of them by Ulysses):

- on ddp, zero1, zero2, zero3 and fsdp (fp32, clip 1.0 that engages, 2 micro-batches
  accumulated): no farther from the same training in float64 than one fp32 process ([Note:
  the matrix's bound] in test_model_matrix.py);
- fp16: an inf in a split gradient on one rank only skips the step on all four and halves
  the loss scale on all four;
- a zero3 checkpoint written at TP=2 x SP=2 loads at TP=1 x SP=1 (ddp, DP=4) and at TP=4
  (kept-whole key/value heads): the weights equal the saved ones exactly and one more step is
  as accurate as the TP=2 x SP=2 run's, both against the same training in float64 (other
  layouts round their sums otherwise: [Note: calibrated bounds] in tests/_numerics.py);
- ``save_16bit_model`` writes the full weights in bf16, equal to ``get_state_dict`` rounded.
"""

import pytest
from _numerics import assert_verdict

from harness import run_distributed

KIND = "llama"


def _accelerator(backend: str, tp: int, sp: int, mp: str = "no", accum: int = 1):
    from mixprec import Accelerator

    cfg = {"tensor_parallel": {"size": tp}, "sequence_parallel": {"size": sp}}
    return Accelerator(mixed_precision=mp, cpu=True, log_policy=False, backend=backend, config=cfg,
                       gradient_accumulation_steps=accum)


def _prepared(backend: str, tp: int, sp: int, mp: str = "no", accum: int = 1, eps: float = 1e-8) -> tuple:
    """(accelerator, the matrix's tiny model, AdamW), prepared."""
    import torch

    import test_model_matrix as t

    acc = _accelerator(backend, tp, sp, mp=mp, accum=accum)
    model = t._build(KIND)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps))
    return acc, model, opt


def _train(acc, model, opt, steps, micro: int = 1) -> list:
    """Steps of the matrix's global batch (every data rank: DP=1 here, or its share)."""
    import test_model_matrix as t

    losses = []
    mesh = acc.mesh
    for step in steps:
        ids = t._batch(step)
        dp, r = (mesh.dp_size, mesh.dp_rank) if mesh is not None else (acc.num_processes, acc.process_index)
        ids = ids[r * (len(ids) // dp):(r + 1) * (len(ids) // dp)]
        size = len(ids) // micro
        for i in range(micro):
            part = ids[i * size:(i + 1) * size]
            with acc.accumulate(model):
                batch = acc.prepare_sp_inputs(input_ids=part, labels=part)
                loss = model(**batch).loss
                acc.backward(loss)
                if acc.sync_gradients:  # Accelerate's idiom: clip the summed gradient only
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


def _tp_sp(state, save_dir):
    import gc
    import os

    import torch
    import torch.distributed as dist

    import test_model_matrix as t
    from test_tensor_parallel import overflow_steps

    rank = dist.get_rank()
    out = {}
    ref64 = t._reference(KIND, "f64")
    variants = [t._reference(KIND, v) for v in ("f32", "micro", "blocks")]
    keys = [k for k in ref64 if ref64[k].is_floating_point()]
    zero_init = t.zero_init_keys(KIND)

    for backend in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        acc, model, opt = _prepared(backend, 2, 2, accum=2, eps=t.EPS)
        _train(acc, model, opt, range(t.STEPS), micro=2)
        got = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
        out[backend] = (t.matrix_excess(got, variants, ref64, keys, zero_init), sorted(got) == sorted(ref64),
                        acc.mesh.describe())
        acc.end_training()
        del acc, model, opt
        gc.collect()

    # fp16: an inf in one rank's slice of q_proj's gradient (rank 3) skips the step everywhere.
    acc, model, opt = _prepared("zero2", 2, 2, mp="fp16")
    poison = {"on": False}
    model.model.layers[0].self_attn.q_proj.weight.register_hook(
        lambda g: g.fill_(float("inf")) if poison["on"] and rank == 3 else g)

    def loss_of(step):
        ids = t._batch(step)
        return model(**acc.prepare_sp_inputs(input_ids=ids, labels=ids)).loss

    out["fp16"] = overflow_steps(acc, model, opt, poison, loss_of)
    acc.end_training()
    del acc, model, opt
    gc.collect()

    # A checkpoint at TP=2 x SP=2 (zero3), resumed at other layouts: judged against the same
    # 3 steps in float64 ([Note: calibrated bounds] in tests/_numerics.py).
    from _numerics import judge_runs, scalar_excess

    judge, ref64_3, spread_3 = judge_runs(lambda: t._build(KIND), [t._batch(s) for s in range(3)], clip=1.0, eps=t.EPS)
    acc, model, opt = _prepared("zero3", 2, 2, eps=t.EPS)
    _train(acc, model, opt, range(2))
    acc.save_state(save_dir)
    saved = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    cont = _train(acc, model, opt, [2])
    cont_w = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    acc.end_training()
    del acc, model, opt
    gc.collect()
    out["resume"] = {"tp2-sp2": (True, scalar_excess(cont, ref64_3["losses"][2:], [r["losses"][2:] for r in spread_3]),
                                 judge.verdict(cont_w))}
    for name, (backend, tp, sp) in {"ddp-dp4": ("ddp", 1, 1), "tp4": ("zero2", 4, 1)}.items():
        acc, model, opt = _prepared(backend, tp, sp, eps=t.EPS)
        acc.load_state(save_dir)
        loaded = acc.get_state_dict(model)
        same = all(torch.equal(loaded[k], saved[k]) for k in saved)
        loss = _train(acc, model, opt, [2])
        w = acc.get_state_dict(model)
        out["resume"][name] = (same, scalar_excess(loss, ref64_3["losses"][2:], [r["losses"][2:] for r in spread_3]),
                               judge.verdict(w))
        acc.end_training()
        del acc, model, opt
        gc.collect()

    # save_16bit_model at TP=2 x SP=2 (fsdp, bf16).
    acc, model, opt = _prepared("fsdp", 2, 2, mp="bf16")
    _train(acc, model, opt, [0])
    d = os.path.join(save_dir, "16bit")
    written = acc.save_16bit_model(model, d)
    full = acc.get_state_dict(model)
    acc.wait_for_everyone()
    sd = torch.load(os.path.join(d, "pytorch_model.bin"), weights_only=True)
    out["16bit"] = (written, sorted(sd) == sorted(full), {str(v.dtype) for v in sd.values()},
                    all(torch.equal(sd[k], full[k].to(torch.bfloat16)) for k in full))
    acc.end_training()
    return out


def test_tp2_x_sp2_on_four_processes(tmp_path):
    pytest.importorskip("transformers")
    results = run_distributed(_tp_sp, 4, args=(str(tmp_path / "ckpt"),), timeout=900)
    for rank, r in enumerate(results):
        for backend in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            (excess, tensor, escapes), keys_ok, mesh = r[backend]
            assert keys_ok and excess <= 1.0 and not escapes, (rank, backend, excess, tensor, escapes)
            assert "sp=2 x tp=2" in mesh, mesh
        steps, scales, skipped = r["fp16"]
        assert [s[0] for s in steps] == [True, False, True] and steps[1][1] and steps[1][2], (rank, steps)
        assert scales[1] == scales[0] / 2 and skipped == 1, (rank, scales, skipped)
        assert scales == results[0]["fp16"][1], (rank, scales)
        for name, (same, loss_excess, verdict) in r["resume"].items():
            assert same, (rank, name)
            assert loss_excess <= 1.0, (rank, name, loss_excess)
            assert_verdict(verdict, (rank, name))
        written, keys_ok, dtypes, equal = r["16bit"]
        assert keys_ok and dtypes == {"torch.bfloat16"} and equal, (rank, r["16bit"])
        assert written == (rank == 0) or written is True, (rank, written)
