"""A model built on the meta device (``accelerator.init_empty_weights()``) is materialised at
``prepare()`` ([Note: materialising a meta model shard by shard] in
src/mixprec/parallel/materialize.py): under TP=2 each rank holds only its shards, and the
weights (gathered whole) are exactly those one process materialises from the same seed; on
ddp the whole model. Tied embeddings stay one tensor; a parameter nobody initialises is an
error naming it. Peak memory is measured by benchmarks/bench_tp_init.py (the OS's VmHWM)."""

import pytest

from harness import run_distributed


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=True))


def _reference() -> dict:
    """One process, no Accelerator: the same meta model materialised from the same seed."""
    import torch

    from mixprec import init_empty_weights
    from mixprec.parallel.materialize import materialize

    with init_empty_weights():
        model = _qwen2()
    torch.manual_seed(0)
    materialize(model, torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _runs(state):
    import torch
    from torch import nn

    from mixprec import Accelerator

    ref = _reference()
    out = {"ref_finite": all(bool(torch.isfinite(v).all()) for v in ref.values()),
           # HF's own init rule: norms at one, Linear weights normal(0, 0.02)
           "ref_rule": bool((ref["model.norm.weight"] == 1).all())
           and 0.015 < float(ref["model.layers.0.mlp.up_proj.weight"].std()) < 0.025}
    for name, cfg in (("tp2", {"tensor_parallel": {"size": 2}}), ("ddp", {})):
        acc = Accelerator(mixed_precision="no", cpu=True, log_policy=False, backend="ddp", config=cfg)
        with acc.init_empty_weights():
            model = _qwen2()
        meta = all(p.is_meta for p in model.parameters())
        torch.manual_seed(0)
        model = acc.prepare(model)
        local = sum(p.numel() for p in model.parameters())
        got = acc.get_state_dict(model)
        equal = sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
        opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        result = opt.step()
        out[name] = {"meta_before": meta,
                     "equal": equal,
                     "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                     "local": local, "stepped": bool(result.stepped)}
        acc.end_training()
    # A parameter that neither the model's _init_weights nor reset_parameters() initialises.
    acc = Accelerator(mixed_precision="no", cpu=True, log_policy=False, backend="ddp")

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.empty(4))

        def forward(self, x):
            return x * self.gain

    with acc.init_empty_weights():
        bad = nn.Sequential(nn.Linear(4, 4), Scale())
    try:
        acc.prepare(bad)
        out["uninitialised"] = "prepared"
    except ValueError as e:
        out["uninitialised"] = str(e)
    acc.end_training()
    return out


def test_meta_model_materialises_shard_by_shard():
    pytest.importorskip("transformers")
    for rank, r in enumerate(run_distributed(_runs, 2, timeout=300)):
        assert r["ref_finite"] and r["ref_rule"], r
        for name in ("tp2", "ddp"):
            assert r[name]["meta_before"] and r[name]["equal"] and r[name]["tied"] and r[name]["stepped"], (rank, r)
        assert r["tp2"]["local"] < 0.75 * r["ddp"]["local"], (r["tp2"], r["ddp"])  # shards, not the whole
        assert "1.gain" in r["uninitialised"] and "Scale" in r["uninitialised"], r["uninitialised"]
