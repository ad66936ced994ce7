"""Model-family presets of tensor-parallel partitions (``tensor_parallel.preset_model``).

Each preset is an ordered list of ``(regex, partition_type, shape)``: the regex is searched in
a module's path (``model.layers.0.self_attn.q_proj``), ``partition_type`` is ``column``
(the weight's output dimension split), ``row`` (its input dimension split; output summed
over the TP group) or ``skip`` (replicated). ``shape`` describes a fused weight's
sub-parameters along the split dimension (DeepSpeed's ``partition_config.layer_specs``
notation): a list of sizes, where the names ``q`` / ``kv`` stand for
``num_attention_heads * head_dim`` / ``num_key_value_heads * head_dim`` of the model's
config, or an int ``k``: ``k`` equal sub-parameters. Each sub-parameter is split on its own
and the local pieces are concatenated, so a rank's fused QKV holds its own heads of each of
Q, K and V (docs/tensor_parallel.md).

A model whose ``config.model_type`` is a preset's name gets it when it has no Hugging Face
plan (the plan resolution order is in parallel/tensor/plan.py). Every preset is tested on the
installed transformers' model of that name (tests/distributed/test_model_matrix.py); the
presets that model family could not run were removed, not kept untested: ``phi3`` (its
attention reads the query size from the config: its own Hugging Face plan gathers qkv),
``bloom`` (its ALiBi biases are built for every head outside the attention) and
``chatglm`` (remote code, not installable here).
"""

from __future__ import annotations

_ATTN_QKV = (r"\.(self_attn|attention)\.(q_proj|k_proj|v_proj)$", "column", None)
_ATTN_O = (r"\.(self_attn|attention)\.o_proj$", "row", None)
_MLP_IN = (r"\.mlp\.(gate_proj|up_proj)$", "column", None)
_MLP_OUT = (r"\.mlp\.down_proj$", "row", None)

PRESETS: dict[str, list[tuple[str, str, object]]] = {
    "llama": [_ATTN_QKV, _ATTN_O, _MLP_IN, _MLP_OUT],
    "qwen2": [_ATTN_QKV, _ATTN_O, _MLP_IN, _MLP_OUT],
    "mixtral": [
        _ATTN_QKV, _ATTN_O,
        (r"\.block_sparse_moe\.gate$", "skip", None),  # the router sees every expert
        (r"\.experts\.\d+\.(w1|w3)$", "column", None),
        (r"\.experts\.\d+\.w2$", "row", None),
    ],
    "deepseek_v2": [
        (r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)$", "column", None),
        (r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)$", "skip", None),  # MLA's low-rank inputs
        (r"\.self_attn\.o_proj$", "row", None),
        (r"\.mlp\.gate$", "skip", None),
        (r"\.(mlp|experts\.\d+|shared_experts)\.(gate_proj|up_proj)$", "column", None),
        (r"\.(mlp|experts\.\d+|shared_experts)\.down_proj$", "row", None),
    ],
    # GPT-2's transformers Conv1D layers (weight [in, out]; split on out for column, in for row).
    # c_attn is q, k and v of hidden_size each; the attention reads ``split_size`` (localised).
    # The tied wte / lm_head stay whole.
    "gpt2": [
        (r"\.attn\.c_attn$", "column", 3),
        (r"\.attn\.c_proj$", "row", None),
        (r"\.mlp\.c_fc$", "column", None),
        (r"\.mlp\.c_proj$", "row", None),
    ],
}

# Name heuristics, the last resort for a Linear no plan names (and only when
# use_default_specs): the usual names of attention and MLP projections.
HEURISTICS: list[tuple[str, str, object]] = [
    (r"(^|\.)(q_proj|k_proj|v_proj|query|key|value|wq|wk|wv|gate_proj|up_proj|fc1|w1|w3|fc_in|"
     r"dense_h_to_4h)$", "column", None),
    (r"(^|\.)(o_proj|out_proj|wo|down_proj|fc2|w2|fc_out|dense_4h_to_h)$", "row", None),
]
