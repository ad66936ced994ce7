"""Activation checkpointing on one process: bitwise-equal gradients and parameters with and
without it (fp32, bf16, keep_fp32 regions inside, dropout), the recomputation really runs,
the model keeps its identity and state_dict keys, and bad values are refused clearly."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from _ckpt_models import Block, block_calls, make_stack, stack_batches
from _helpers import loss_fn
from mixprec import Accelerator
from mixprec import activation_checkpointing as act_ckpt
from mixprec.config import ConfigError
from mixprec.config.resolve import resolve
from mixprec.config.schema import ActivationCheckpointingOptions


def _train(steps, mixed_precision="no", checkpointing=None, **kw):
    """Per step: the loss, every parameter's gradient, every parameter after the step."""
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, backend="single", log_policy=False,
                      fused_optimizer=False, activation_checkpointing=checkpointing, **kw)
    model = make_stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, optimizer)
    torch.manual_seed(1234)  # the dropout masks
    out = []
    for x, y in stack_batches(steps):
        loss = loss_fn(model(x), y)
        acc.backward(loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append((loss.detach().clone(), grads, params))
    return out, model, acc


def _assert_bitwise(ours, ref):
    assert len(ours) == len(ref)
    for step, ((l1, g1, p1), (l2, g2, p2)) in enumerate(zip(ours, ref)):
        assert torch.equal(l1, l2), (step, l1, l2)
        assert g1.keys() == g2.keys()
        for n in g2:
            assert torch.equal(g1[n], g2[n]), (step, "grad", n, (g1[n] - g2[n]).abs().max())
            assert torch.equal(p1[n], p2[n]), (step, "param", n)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("spec", [["Block"], ["blocks.*"], [Block]])
def test_bitwise_equal_with_and_without(mixed_precision, spec):
    ref, ref_model, _ = _train(3, mixed_precision)
    ours, model, _ = _train(3, mixed_precision, spec)
    _assert_bitwise(ours, ref)
    assert block_calls(ref_model) == [3, 3, 3]
    assert block_calls(model) == [6, 6, 6]  # forward + recomputation in backward, every step
    assert act_ckpt.checkpointed_modules(model) == ["blocks.0", "blocks.1", "blocks.2"]


def test_dropout_is_active_so_rng_preservation_matters():
    """Without the restored RNG state the recomputed dropout masks would differ: the model's
    output depends on the RNG (dropout on), which the bitwise test relies on."""
    model = make_stack()
    x = stack_batches(1)[0][0]
    torch.manual_seed(0)
    a = model(x)
    b = model(x)
    assert not torch.equal(a, b)


def test_keep_fp32_region_inside_a_checkpointed_module_bf16():
    """A keep_fp32 module (its own policy context) inside a checkpointed block recomputes in
    the same dtypes: bitwise equal, and its class swap keeps the checkpointing on unwrap."""
    ref, _, _ = _train(2, "bf16", keep_fp32_modules=("LayerNorm",))
    ours, model, acc = _train(2, "bf16", ["Block"], keep_fp32_modules=("LayerNorm",))
    _assert_bitwise(ours, ref)
    assert block_calls(model) == [4, 4, 4]
    acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert act_ckpt.checkpointed_modules(model) == ["blocks.0", "blocks.1", "blocks.2"]


def test_autocast_disabled_region_recomputes_in_fp32():
    """Forward inside accelerator.autocast(enabled=False) runs in fp32; the recomputation in
    backward (outside that region) must too, or the saved dtypes differ (checkpoint's
    determinism check raises) and the gradients change."""
    grads = []
    for spec in (None, ["Block"]):
        acc = Accelerator(mixed_precision="bf16", cpu=True, backend="single", log_policy=False,
                          activation_checkpointing=spec)
        model = acc.prepare(make_stack())
        x, y = stack_batches(1)[0]
        torch.manual_seed(3)
        with acc.autocast(enabled=False):
            out = model(x)
        assert out.dtype == torch.float32
        acc.backward(loss_fn(out, y))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_same_object_same_state_dict_keys_and_no_recompute_without_grad():
    plain = make_stack()
    keys = list(plain.state_dict())
    acc = Accelerator(cpu=True, backend="single", log_policy=False, activation_checkpointing=["Block"])
    model = acc.prepare(plain)
    assert model is plain
    assert list(model.state_dict()) == keys
    assert type(model.blocks[0]).__name__ == "Block" and isinstance(model.blocks[0], Block)
    with torch.no_grad():
        model(stack_batches(1)[0][0])
    assert block_calls(model) == [1, 1, 1]
    act_ckpt.remove(model)
    assert act_ckpt.checkpointed_modules(model) == [] and type(model.blocks[0]) is Block


def test_outermost_module_only():
    model = make_stack()
    chosen = act_ckpt.select_modules(model, ["Block", "Linear"])
    names = [n for n, _ in chosen]
    # Linears inside a Block are recomputed with it; embed and head are checkpointed alone.
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_config_sources():
    """The block comes from a file/dict, env vars or the argument; sources must agree."""
    r = resolve({"activation_checkpointing": {"modules": ["Block"]}}, env={})
    assert r.config.activation_checkpointing.modules == ("Block",)
    r = resolve(None, env={"MIXPREC_ACTIVATION_CHECKPOINTING_MODULES": "Block,head",
                           "MIXPREC_ACTIVATION_CHECKPOINTING_UNITS": "true"})
    assert r.config.activation_checkpointing == ActivationCheckpointingOptions(modules=("Block", "head"), units=True)
    args = act_ckpt.config_args(ActivationCheckpointingOptions(units=True))
    assert args == {"activation_checkpointing.units": (True, "activation_checkpointing.units")}
    with pytest.raises(ConfigError, match="given twice"):
        Accelerator(cpu=True, backend="single", config={"activation_checkpointing": {"modules": ["head"]}},
                    activation_checkpointing=["Block"])


def test_unknown_module_lists_the_model_classes():
    acc = Accelerator(cpu=True, backend="single", log_policy=False, activation_checkpointing=["Blok"])
    model = make_stack()
    with pytest.raises(ValueError, match=r"'Blok' matched no module of Stack.*'Block'.*'MultiheadAttention'"):
        acc.prepare(model)
    assert act_ckpt.checkpointed_modules(model) == []


def test_root_is_refused():
    with pytest.raises(ValueError, match="names only the model itself"):
        act_ckpt.select_modules(make_stack(), ["Stack"])
    with pytest.raises(ValueError, match="names only the model itself"):
        act_ckpt.select_modules(make_stack(), [""])


def test_units_need_a_sharding_backend():
    acc = Accelerator(cpu=True, backend="single", log_policy=False, activation_checkpointing={"units": True})
    with pytest.raises(ConfigError, match="backend is 'single', which has no units"):
        acc.prepare(make_stack())


def test_units_must_make_a_unit():
    engine = types.SimpleNamespace(name="zero3", comm=types.SimpleNamespace(units_spec=()))
    with pytest.raises(ConfigError, match=r"zero3.units=\(\) makes no unit below the root of Stack"):
        act_ckpt.plan(make_stack(), ActivationCheckpointingOptions(units=True), engine)
    engine = types.SimpleNamespace(name="fsdp", comm=types.SimpleNamespace(units_spec=["Block"]))
    chosen = act_ckpt.plan(make_stack(), ActivationCheckpointingOptions(units=True), engine)
    assert [n for n, _ in chosen] == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("bad, error, match", [
    (True, TypeError, "must be a list of module classes"),
    ({"modulez": ["Block"]}, ConfigError, r"unknown key\(s\) \['modulez'\]"),
    ({"units": "yes please"}, ConfigError, "activation_checkpointing.units='yes please' must be true or false"),
    ([3], ConfigError, "activation_checkpointing.modules"),
])
def test_bad_argument(bad, error, match):
    with pytest.raises(error, match=match):
        Accelerator(cpu=True, backend="single", log_policy=False, activation_checkpointing=bad)


def test_plain_module_checkpointing_matches_torch_checkpoint():
    """Our class swap gives exactly what a hand-written torch.utils.checkpoint call gives."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = Block(16, 2, 0.2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    torch.manual_seed(5)
    ref = checkpoint(lambda t: block(t, scale=0.5), x, use_reentrant=False)
    ref.sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    act_ckpt.apply([("", block)])
    torch.manual_seed(5)
    out = block(x, scale=0.5)
    out.sum().backward()
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip([x.grad] + [p.grad for p in block.parameters()], ref_grads))
    assert isinstance(block, nn.Module) and block.calls == 4


# ------------------------------------------------ selective checkpointing, on an HF decoder
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, attn_implementation="sdpa"))


def _hf_backward(checkpointing, caplog, **forward_kw):
    """(loss, gradients, attention kernels run in backward) of one bf16 backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            Count.calls += name.startswith("aten._scaled_dot_product") and "backward" not in name
            return func(*args, **(kwargs or {}))

    acc = Accelerator(mixed_precision="bf16", cpu=True, backend="single", log_policy=False,
                      activation_checkpointing=checkpointing)
    model = acc.prepare(_llama())
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=ids, labels=ids, **forward_kw).loss
    with Count():
        acc.backward(loss)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, Count.calls


def test_selective_keeps_attention_outputs_and_matches_bitwise(caplog):
    """selective: the attention kernels are not run again in backward (whole checkpointing
    runs one per layer), and the gradients equal no checkpointing's bit for bit."""
    pytest.importorskip("transformers")
    act_ckpt._warned_cache.clear()
    loss, grads, calls = _hf_backward(None, caplog)
    assert calls == 0
    for spec, recomputed in (({"modules": ["LlamaDecoderLayer"]}, 2),
                             ({"modules": ["LlamaDecoderLayer"], "selective": True}, 0)):
        got_loss, got, got_calls = _hf_backward(spec, caplog)
        assert got_calls == recomputed, (spec, got_calls)
        assert torch.equal(got_loss, loss)
        assert all(torch.equal(got[k], v) for k, v in grads.items()), spec


def test_kv_cache_is_not_passed_to_checkpointed_layers(caplog):
    """HF makes an empty cache for every forward with use_cache on: a checkpointed layer gets
    none (said once, naming the class; selective checkpointing failed on the second append
    before), use_cache=False is quiet, and a cache that already holds tokens is refused."""
    pytest.importorskip("transformers")
    act_ckpt._warned_cache.clear()
    spec = {"modules": ["LlamaDecoderLayer"], "selective": True}
    with caplog.at_level("WARNING"):
        _hf_backward(spec, caplog)
        _hf_backward(spec, caplog)
    said = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert len(said) == 1 and "LlamaDecoderLayer is called with an empty KV cache" in said[0], said
    caplog.clear()
    act_ckpt._warned_cache.clear()
    with caplog.at_level("WARNING"):
        _hf_backward(spec, caplog, use_cache=False)
    assert not [r for r in caplog.records if "KV cache" in r.getMessage()]

    from transformers import DynamicCache

    model = _llama()
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        prefix = model(input_ids=ids, use_cache=True).past_key_values  # 6 tokens cached
    acc = Accelerator(cpu=True, backend="single", log_policy=False, activation_checkpointing=spec)
    model = acc.prepare(model)
    assert isinstance(prefix, DynamicCache) and prefix.get_seq_length() == 6
    import warnings

    with pytest.raises(ValueError, match=r"LlamaDecoderLayer is called in a training forward with \w+= a KV "
                                         r"cache that already holds 6 token\(s\)"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames past_key_values to cache
        model(input_ids=ids, use_cache=True, past_key_values=prefix)
