"""fp16 matmuls on a CPU without fp16 arithmetic run as widened fp32 GEMMs
([Note: fp16 GEMMs on a CPU without fp16 arithmetic] in src/mixprec/wrappers/half_gemm.py).

The rule for right: the widened run is no farther from a float64 run than torch's own
fp16 autocast run is (same weights, same batch), tensor by tensor, with 25% slack for the
different fp32 summation order; and every dtype in the graph is autocast's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec
from mixprec.wrappers import half_gemm
from mixprec.wrappers.half_gemm import HalfGemmMode, _WidenedGemm


class Mixer(nn.Module):
    """Linear layers, a weight used twice, a bmm, an addmm and a 2-D matmul: every rerouted
    form."""

    def __init__(self, d: int = 128):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.proj = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.conv_w = nn.Parameter(torch.randn(d, d) / d**0.5)  # GPT-2's Conv1D: addmm(bias, x, w)
        self.conv_b = nn.Parameter(torch.zeros(d))

    def forward(self, x):  # x (B, S, d)
        h = self.down(nn.functional.gelu(self.up(x)))
        h = h + self.down(nn.functional.gelu(self.up(h)))  # up/down used twice in one forward
        scores = torch.bmm(h, h.transpose(1, 2)) / h.shape[-1]
        h = torch.bmm(scores.softmax(-1), h)
        heads = h.reshape(*h.shape[:2], 4, -1).transpose(1, 2)  # (B, 4, S, d/4): eager attention's products
        att = (heads @ heads.transpose(-1, -2)).softmax(-1)
        h = h + torch.matmul(att, heads).transpose(1, 2).reshape(h.shape)
        h = torch.addmm(self.conv_b, h.reshape(-1, h.shape[-1]), self.conv_w).reshape(h.shape)
        return h @ self.proj


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, mode: bool, dtype=torch.float16):
    model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        if mode:
            with HalfGemmMode():
                out = model(x)
        else:
            out = model(x)
    loss = nn.functional.mse_loss(out.float(), y)
    loss.backward()
    return out, loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _data(d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 64, d, generator=g), torch.randn(4, 64, d, generator=g)


def test_widened_gemms_are_as_close_to_float64_as_torchs_fp16_kernels():
    torch.manual_seed(0)
    model = Mixer()
    x, y = _data()
    ref = {n: g.double() for n, g in _grads(model.double(), x.double(), y.double(), mode=False, dtype=None)[2].items()}
    model = model.float()
    calls = []
    real_apply = _WidenedGemm.apply
    try:
        _WidenedGemm.apply = lambda *a: (calls.append(a[0]), real_apply(*a))[1]
        out_w, loss_w, widened = _grads(model, x, y, mode=True)
    finally:
        _WidenedGemm.apply = real_apply
    out_n, loss_n, native = _grads(model, x, y, mode=False)
    assert sorted(set(calls)) == ["addmm", "bmm", "linear", "matmul2"], calls  # every form really rerouted
    assert calls.count("bmm") == 4, calls  # the two 3-D bmm and the two 4-D matmuls
    assert out_w.dtype == out_n.dtype == torch.float16
    for name, r in ref.items():
        assert widened[name].dtype == native[name].dtype == torch.float32, name
        err_w = (widened[name].double() - r).norm() / r.norm()
        err_n = (native[name].double() - r).norm() / r.norm()
        assert err_w <= 1.25 * err_n + 1e-7, (name, float(err_w), float(err_n))
        assert err_n > 1e-5, (name, float(err_n))  # fp16 really ran: the bound is not vacuous
    assert abs(float(loss_w) - float(loss_n)) <= 1e-3 * abs(float(loss_n))


def _hf_model(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        config = transformers.LlamaConfig(intermediate_size=256, num_key_value_heads=2, **common)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


class _LM(nn.Module):
    """An HF causal LM as ``(ids) -> logits`` for ``_grads``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_models_are_as_close_to_float64_as_torchs_fp16_kernels(kind):
    model = _LM(_hf_model(kind))
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    y = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(1))
    ref = _grads(copy.deepcopy(model).double(), ids, y.double(), mode=False, dtype=None)[2]
    calls = []
    real_apply = _WidenedGemm.apply
    try:
        _WidenedGemm.apply = lambda *a: (calls.append(a[0]), real_apply(*a))[1]
        widened = _grads(model, ids, y, mode=True)[2]
    finally:
        _WidenedGemm.apply = real_apply
    native = _grads(model, ids, y, mode=False)[2]
    assert len(calls) >= 8, calls  # the projections really were widened
    worst = 0.0
    for name, r in ref.items():
        r = r.double()
        if r.norm() == 0:
            continue
        err_w = float((widened[name].double() - r).norm() / r.norm())
        err_n = float((native[name].double() - r).norm() / r.norm())
        assert err_w <= 1.25 * err_n + 1e-6, (name, err_w, err_n)
        worst = max(worst, err_n)
    assert worst > 1e-4  # fp16 really ran: the bound is not vacuous


def test_a_weight_used_twice_is_cast_once_per_forward():
    model = Mixer()
    x, _ = _data()
    seen = []
    real_apply = _WidenedGemm.apply
    try:
        _WidenedGemm.apply = lambda *a: (seen.append(a[2]), real_apply(*a))[1]
        with torch.autocast("cpu", dtype=torch.float16), HalfGemmMode():
            model(x)
    finally:
        _WidenedGemm.apply = real_apply
    up_casts = [t for t in seen if t.shape == model.up.weight.shape]
    assert len(up_casts) == 2 and up_casts[0] is up_casts[1]  # autocast's cast cache, per forward


@pytest.mark.parametrize("case", ["float64", "small", "autocast_off", "bf16", "out", "vmap"])
def test_what_it_leaves_to_torch(case):
    calls = []
    real_apply = _WidenedGemm.apply
    a, b = torch.randn(256, 512), torch.randn(512, 256, requires_grad=True)
    try:
        _WidenedGemm.apply = lambda *args: (calls.append(args[0]), real_apply(*args))[1]
        with torch.autocast("cpu", dtype=torch.bfloat16 if case == "bf16" else torch.float16,
                            enabled=case != "autocast_off"), HalfGemmMode():
            if case == "float64":
                out = torch.mm(a.double(), b.double())
            elif case == "small":
                out = torch.mm(a[:4, :8], b[:8, :4])
            elif case == "vmap":
                out = torch.func.vmap(lambda r: r @ b)(a.reshape(2, 128, 512))
            elif case == "out":
                out = torch.empty(256, 256, dtype=torch.float16)
                torch.mm(a.half(), b.detach().half(), out=out)
            else:
                out = a @ b
    finally:
        _WidenedGemm.apply = real_apply
    assert calls == []
    expected = {"float64": torch.float64, "small": torch.float16, "autocast_off": torch.float32,
                "bf16": torch.bfloat16, "out": torch.float16, "vmap": torch.float16}[case]
    assert out.dtype == expected


def _train(setting: str, steps: int = 3):
    torch.manual_seed(0)
    model = Mixer()
    acc = mixprec.Accelerator(mixed_precision="fp16", cpu=True, log_policy=False,
                              config={"cpu_fp16_matmul": setting})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    x, y = _data()
    calls = []
    real_apply = _WidenedGemm.apply
    try:
        _WidenedGemm.apply = lambda *a: (calls.append(a[0]), real_apply(*a))[1]
        losses = []
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            assert opt.step().stepped
            opt.zero_grad()
            losses.append(float(loss.detach()))
    finally:
        _WidenedGemm.apply = real_apply
        acc.end_training()
    return losses, calls


def test_the_prepared_model_follows_the_config():
    widened, calls_w = _train("fp32")
    native, calls_n = _train("native")
    auto, calls_a = _train("auto")
    assert calls_w and not calls_n
    assert bool(calls_a) == (not half_gemm.cpu_has_fp16_arithmetic())
    for a, b in zip(widened, native):
        assert abs(a - b) <= 1e-3 * abs(b)


def test_a_bad_setting_names_the_value():
    with pytest.raises(Exception, match="cpu_fp16_matmul"):
        mixprec.Accelerator(mixed_precision="fp16", cpu=True, log_policy=False,
                            config={"cpu_fp16_matmul": "fast"})


def test_activation_checkpointing_recomputes_the_same_products():
    """The recomputation in backward runs inside the mode too: checkpointed and plain runs
    give bitwise equal gradients."""
    grads = {}
    for ckpt in (None, ["Mixer"]):
        torch.manual_seed(0)
        model = nn.Sequential(Mixer(), Mixer())
        acc = mixprec.Accelerator(mixed_precision="fp16", cpu=True, log_policy=False, fused_optimizer=False,
                                  activation_checkpointing=ckpt, config={"cpu_fp16_matmul": "fp32"})
        model = acc.prepare(model)
        x, y = _data()
        calls = []
        real_apply = _WidenedGemm.apply
        try:
            _WidenedGemm.apply = lambda *a: (calls.append(a[0]), real_apply(*a))[1]
            loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
        finally:
            _WidenedGemm.apply = real_apply
        grads[bool(ckpt)] = ([p.grad.clone() for p in model.parameters()], len(calls))
        acc.end_training()
    assert grads[True][1] == 2 * grads[False][1]  # the checkpointed forward ran twice, widened both times
    assert all(torch.equal(a, b) for a, b in zip(grads[True][0], grads[False][0]))


def _fp16_grads(fn, mode: bool, *leaves):
    """``fn()`` under fp16 autocast (with or without the mode), its sum backpropagated:
    the leaves' gradients."""
    with torch.autocast("cpu", dtype=torch.float16):
        if mode:
            with HalfGemmMode():
                out = fn()
        else:
            out = fn()
    out.float().sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return grads


def test_a_weight_first_used_under_no_grad_still_gets_its_gradient():
    """Review finding: the cast cache handed a cast made under no_grad (no history) to a
    later use with grad, and the weight got no gradient at all."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(256, 256) / 16)
    x = torch.randn(64, 256)

    def fn():
        with torch.no_grad():
            target = nn.functional.linear(x, w)
        return nn.functional.linear(x, w) - target.detach()

    ref, got = _fp16_grads(fn, False, w), _fp16_grads(fn, True, w)
    assert got[0].norm() > 0
    assert float((got[0] - ref[0]).norm() / ref[0].norm()) < 1e-3


def test_double_backward_goes_through_the_widened_products():
    """A gradient penalty (create_graph) through a widened linear, as under torch's fp16."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(256, 256) / 16)
    x = torch.randn(64, 256, requires_grad=True)
    norms = []
    for mode in (False, True):
        with torch.autocast("cpu", dtype=torch.float16):
            if mode:
                with HalfGemmMode():
                    out = nn.functional.linear(x, w)
            else:
                out = nn.functional.linear(x, w)
        gx, = torch.autograd.grad(out.float().pow(2).sum(), x, create_graph=True)
        gx.float().pow(2).sum().backward()
        norms.append(float(w.grad.norm()))
        w.grad = None
    assert abs(norms[1] - norms[0]) <= 1e-3 * norms[0], norms


def test_mm_of_3d_tensors_raises_torchs_error():
    a, b = torch.randn(4, 64, 128), torch.randn(4, 128, 64)
    with torch.autocast("cpu", dtype=torch.float16), HalfGemmMode(), pytest.raises(RuntimeError, match="matrix"):
        torch.mm(a, b)
