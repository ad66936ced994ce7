"""Tiny models of every causal-LM type for the parallelism model matrix
(tests/distributed/test_model_matrix.py): each built from its transformers default config,
shrunk to a few thousand parameters. Not a test file.

``matrix_types()``: every ``model_type`` of transformers' causal-LM mapping whose config has a
``base_model_tp_plan``, plus the types a mixprec preset names (parallel/tensor/presets.py).
``build(model_type)``: the tiny model (seed 0, fp32, dropout off, SDPA where the model
supports it, else eager), or raises :class:`NotBuilt` naming why the generic shrinking did not
give a model that runs one forward and backward (the matrix lists those apart).
"""

from __future__ import annotations

import warnings

VOCAB = 64
MAX_PARAMS = 2_000_000  # above this the config kept parts the shrinking does not know (vision towers...)

# Set where the config has the attribute (the usual names of sizes across families).
_SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    num_experts=4, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    shared_expert_intermediate_size=16, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_embd=32, n_head=4, n_layer=2, n_positions=64,
    n_inner=64, ffn_hidden_size=64, sliding_window=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # dropout off: the runs are compared with a float64 one, mask for mask
    hidden_dropout=0.0, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, summary_first_dropout=0.0, residual_dropout=0.0,
)


class NotBuilt(RuntimeError):
    """The generic shrinking gives no running model of this type."""


def matrix_types() -> list[str]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from mixprec.parallel.tensor.presets import PRESETS

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                cfg = AutoConfig.for_model(mt)
            except Exception:  # noqa: BLE001 - a config that needs remote code or arguments
                continue
            if getattr(cfg, "base_model_tp_plan", None) or mt in PRESETS:
                out.append(mt)
    return out


def tiny_config(model_type: str):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    for key, value in _SIZES.items():
        if hasattr(cfg, key) and not isinstance(getattr(cfg, key), dict):
            try:
                setattr(cfg, key, value)
            except Exception:  # noqa: BLE001 - a derived (read-only) attribute
                pass
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
        kinds = getattr(cfg, key, None)
        if isinstance(kinds, (list, tuple)) and len(kinds) > 2:
            distinct = list(dict.fromkeys(kinds))  # one layer of the first and of the last kind
            try:
                setattr(cfg, key, [distinct[0], distinct[-1]] if len(distinct) > 1 else list(kinds)[:2])
            except Exception:  # noqa: BLE001
                pass
    if isinstance(getattr(cfg, "qk_rope_head_dim", None), int):  # MLA: rope over qk_rope_head_dim
        try:
            cfg.head_dim = cfg.qk_rope_head_dim
        except Exception:  # noqa: BLE001
            pass
    return cfg


def build(model_type: str):
    import torch
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = tiny_config(model_type)
            # MoE experts as plain loops (the grouped kernels take no float64 for the reference)
            cfg._experts_implementation = "eager"
            with torch.device("meta"):  # counted before anything is allocated
                n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
            if n > MAX_PARAMS:
                raise ValueError(f"the generic shrinking leaves {n} parameters (parts it does not know)")
            torch.manual_seed(0)
            try:
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
            except ValueError as e:
                if "does not support an attention implementation" not in str(e):
                    raise
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
            ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
            model.double()(input_ids=ids, labels=ids).loss.backward()  # the float64 reference runs too
            model.zero_grad(set_to_none=True)
        except Exception as e:  # noqa: BLE001
            raise NotBuilt(f"{type(e).__name__}: {str(e)[:160]}") from None
    return model.float()  # the fp32 values of the seed-0 initialisation, exactly
