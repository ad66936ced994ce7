"""What a sharded engine holds between steps ([Note: what lives between steps] in
csrc/engines/sharded/core.h): after ``optimizer.zero_grad()`` (set_to_none, torch's default)
no gradient memory at all (the fp32 gradient shard, and zero1's full fp32 buckets, are freed),
``set_to_none=False`` keeps them zeroed, a ``.grad`` the user still holds keeps its values, and
no low-precision copy of the master shard exists: the gathers round the masters. 2 processes.
"""

import pytest

from harness import run_distributed


def _lifetime(state, backend):
    import torch

    from _helpers import loss_fn, make_transformer, transformer_batches
    from mixprec import Accelerator

    opts = {"units": ["Linear"]} if backend in ("zero3", "fsdp") else None
    acc = Accelerator(mixed_precision="bf16", backend=backend, cpu=True, log_policy=False,
                      param_dtype=torch.bfloat16, engine_options=opts)
    model = make_transformer()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    cores = acc.engine.comm.all_cores()
    masters = [p for g in opt.param_groups for p in g["params"]]

    def grad_bytes():
        return sum(c.grad_shard_bytes() + c.grad_bucket_bytes() for c in cores)

    out = {"before_any_backward": grad_bytes()}
    batches = list(transformer_batches(3))
    x, y = batches[0]
    acc.backward(loss_fn(model(x), y))
    opt.step()
    out["after_step"] = grad_bytes()
    out["shard_bytes"] = sum(c.grad_shard_bytes() for c in cores)
    held = masters[0].grad  # the user keeps a reference across zero_grad
    held_copy = held.clone()
    opt.zero_grad()
    out["after_zero_grad"] = grad_bytes()
    out["grads_none"] = all(m.grad is None for m in masters)
    out["held_intact"] = bool(torch.equal(held, held_copy))
    out["persistent_grads"] = acc.engine.persistent_bytes()["grads"]

    x, y = batches[1]
    acc.backward(loss_fn(model(x), y))
    opt.step()
    opt.zero_grad(set_to_none=False)
    out["kept_bytes"] = grad_bytes()
    out["kept_zero"] = all(m.grad is not None and not m.grad.any() for m in masters)

    # A third step from a freed shard still trains: the parameters match the fp32 masters
    # rounded to bf16 (the gathers cast them; no bf16 copy of the shard is kept).
    opt.zero_grad()
    x, y = batches[2]
    acc.backward(loss_fn(model(x), y))
    result = opt.step()
    out["stepped"] = bool(result.stepped)
    full = acc.get_state_dict(model)  # the fp32 masters, gathered
    # zero1/2 hold full parameters between steps (zero3's are gathered only around use).
    out["params_match"] = backend == "zero3" or all(
        torch.equal(p.detach(), full[n].to(p.dtype)) for n, p in model.named_parameters())
    out["lowp_api_gone"] = not hasattr(cores[0], "lowp_shards") and not hasattr(cores[0], "refresh_lowp")
    return out


@pytest.mark.parametrize("backend", ["zero1", "zero2", "zero3"])
def test_zero_grad_frees_gradient_memory(backend):
    for r in run_distributed(_lifetime, 2, args=(backend,)):
        assert r["before_any_backward"] == 0, r  # no gradient shard before the first reduction
        assert r["after_step"] > 0 and r["shard_bytes"] > 0, r
        assert r["after_zero_grad"] == 0 and r["persistent_grads"] == 0, r
        assert r["grads_none"], r
        assert r["held_intact"], r  # torch semantics: a held .grad keeps its values
        assert r["kept_bytes"] > 0 and r["kept_zero"], r  # set_to_none=False: zeroed, kept
        assert r["stepped"] and r["params_match"], r
        assert r["lowp_api_gone"], r


def _model_zero_grad(state, backend, via_model):
    import torch

    from _helpers import loss_fn, make_transformer, transformer_batches
    from mixprec import Accelerator

    opts = {"units": ["Linear"]} if backend == "zero3" else None
    acc = Accelerator(backend=backend, cpu=True, log_policy=False, engine_options=opts)
    model = make_transformer()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    cores = acc.engine.comm.all_cores()
    masters = [p for g in opt.param_groups for p in g["params"]]
    freed, grads_none = [], []
    for x, y in transformer_batches(3):
        acc.backward(loss_fn(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        (model if via_model else opt).zero_grad()
        freed.append(sum(c.grad_shard_bytes() + c.grad_bucket_bytes() for c in cores) == 0)
        grads_none.append(all(m.grad is None for m in masters))
    acc.backward(loss_fn(model(x), y))
    opt.step()
    model.zero_grad(set_to_none=False)
    kept = sum(c.grad_shard_bytes() for c in cores) > 0 and all(m.grad is not None and not m.grad.any()
                                                               for m in masters)
    return freed, grads_none, kept, acc.get_state_dict(model)


@pytest.mark.parametrize("backend", ["zero1", "zero2", "zero3"])
def test_model_zero_grad_frees_gradient_memory(backend):
    # [Note: model.zero_grad() frees the gradient shard] in src/mixprec/engines/zero.py:
    # transformers' Trainer calls model.zero_grad() only. The training is that of
    # optimizer.zero_grad(), bit for bit.
    by_model = run_distributed(_model_zero_grad, 2, args=(backend, True))
    by_opt = run_distributed(_model_zero_grad, 2, args=(backend, False))
    for (freed, grads_none, kept, state), (_, _, _, ref) in zip(by_model, by_opt):
        assert all(freed) and all(grads_none), (freed, grads_none)
        assert kept  # set_to_none=False: zeroed and kept
        assert state.keys() == ref.keys() and all(state[k].equal(ref[k]) for k in ref)
