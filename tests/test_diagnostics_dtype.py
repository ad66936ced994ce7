"""Acceptance (issue #8): a dtype error inside forward names the module path, its dtypes, the
active policy and a fix; other errors pass through untouched."""

import pytest
import torch
from torch import nn

from mixprec import Accelerator, MixprecDtypeError, MixprecError


class Proj(nn.Module):
    """Calls ``proj`` on a float64 copy of its input (the classic stray ``.double()``)."""

    def __init__(self, dim: int = 8, double: bool = True):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.double_input = double

    def forward(self, x):
        return self.proj(x.double() if self.double_input else x)


class Layer(nn.Module):
    def __init__(self, dim: int = 8, double: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.block = Proj(dim, double)

    def forward(self, x):
        return x + self.block(self.norm(x))


class Encoder(nn.Module):
    def __init__(self, dim: int = 8, bad_layer: int = 1):
        super().__init__()
        self.layers = nn.ModuleList([Layer(dim, double=(i == bad_layer)) for i in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Model(nn.Module):
    def __init__(self, dim: int = 8, bad_layer: int = 1):
        super().__init__()
        self.encoder = Encoder(dim, bad_layer)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


def _error(acc, model, *inputs) -> MixprecDtypeError:
    model = acc.prepare(model)
    with pytest.raises(MixprecDtypeError) as info:
        model(*inputs)
    return info.value


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_double_input_in_a_nested_module_names_path_dtypes_policy_and_fix(mixed_precision):
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, log_policy=False)
    err = _error(acc, Model(), torch.randn(4, 8))
    low = {"no": "fp32", "bf16": "bf16"}[mixed_precision]
    assert isinstance(err, RuntimeError) and isinstance(err, MixprecError)  # old handlers still catch it
    assert err.module_path == "encoder.layers.1.block.proj" and err.module_type == "Linear"
    assert err.input_dtypes == {"input": torch.float64}
    assert err.param_dtypes == {"weight": torch.float32, "bias": torch.float32}
    text = str(err)
    assert "'encoder.layers.1.block.proj' (Linear)" in text
    assert f"but got Double and {'Float' if low == 'fp32' else 'BFloat16'}" in text  # torch's words kept
    assert "weight=fp32, bias=fp32" in text and "input=float64 [4, 8]" in text
    assert f"mixed_precision={mixed_precision!r}" in text
    assert ("autocast bf16 on" in text) == (mixed_precision == "bf16")
    assert "cast the float64 input(s) ['input'] to float32" in text
    original = err.__cause__
    assert type(original) is RuntimeError and "must have the same dtype" in str(original)


def test_manually_halved_parameter_under_no_names_it_and_suggests_removing_the_cast():
    model = Model(bad_layer=-1)
    model.encoder.layers[2].block.proj.half()  # weight and bias fp16, the rest fp32
    acc = Accelerator(mixed_precision="no", cpu=True, log_policy=False)
    err = _error(acc, model, torch.randn(4, 8))
    assert err.module_path == "encoder.layers.2.block.proj"
    assert err.param_dtypes == {"weight": torch.float16, "bias": torch.float16}
    assert err.input_dtypes == {"input": torch.float32}
    assert "remove the manual .half()" in str(err) and "['weight', 'bias']" in str(err)
    assert "mixed_precision='no'" in str(err) and "autocast off" in str(err)


def test_conv_bias_of_another_dtype_and_functional_call_in_own_forward():
    class ConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())

        def forward(self, x):
            return self.stem(x)

    net = ConvNet()
    net.stem[0].bias.data = net.stem[0].bias.data.half()
    err = _error(Accelerator(cpu=True, log_policy=False), net, torch.randn(1, 3, 6, 6))
    assert err.module_path == "stem.0" and err.module_type == "Conv2d"
    assert "bias type" in err.original and "bias=fp16" in str(err) and "weight=fp32" in str(err)

    class Mixer(nn.Module):  # the op is in the module's own forward: F.linear with a fp16 table
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(8, 8, dtype=torch.float16))

        def forward(self, x):
            return nn.functional.linear(x, self.table)

    wrapper = nn.Sequential(nn.Linear(8, 8), Mixer())
    err = _error(Accelerator(cpu=True, log_policy=False), wrapper, torch.randn(2, 8))
    assert err.module_path == "1" and err.module_type == "Mixer"
    assert err.buffer_dtypes == {"table": torch.float16} and err.input_dtypes == {"x": torch.float32}
    assert "keep_fp32_modules=['1']" in str(err)


def test_missing_half_kernel_is_still_a_not_implemented_error_and_suggests_fp32():
    class Distances(nn.Module):
        def __init__(self):
            super().__init__()
            self.centers = nn.Parameter(torch.randn(3, 8))

        def forward(self, x):
            return torch.cdist(x.half(), self.centers.half())  # no fp16 cdist on the CPU

    model = nn.Sequential(nn.Linear(8, 8), Distances())
    err = _error(Accelerator(cpu=True, log_policy=False), model, torch.randn(2, 8))
    assert isinstance(err, NotImplementedError) and isinstance(err, MixprecDtypeError)
    assert err.module_path == "1" and "not implemented for 'Half'" in err.original
    assert "no Half kernel on this device" in str(err) and "keep_fp32_modules=['1']" in str(err)
    assert "mixed_precision='bf16'" in str(err)


def test_inside_a_keep_fp32_region_the_path_is_the_full_path():
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False,
                      keep_fp32_modules=("encoder.layers.1",))
    err = _error(acc, Model(), torch.randn(4, 8))
    assert err.module_path == "encoder.layers.1.block.proj"
    assert "(inside keep_fp32 module 'encoder.layers.1': autocast off, fp32 inputs)" in str(err)


def test_errors_that_are_not_about_dtypes_pass_through_untouched():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x[:, :3])  # shape mismatch

    model = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False).prepare(Bad())
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8))
    assert type(info.value) is RuntimeError and "cannot be multiplied" in str(info.value)
    assert info.value.__cause__ is None

    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("not about dtypes")

    model = Accelerator(cpu=True, log_policy=False).prepare(Raises())
    with pytest.raises(ValueError, match="not about dtypes"):
        model(torch.randn(2, 8))


def test_prepared_model_still_trains_after_a_caught_dtype_error():
    acc = Accelerator(mixed_precision="bf16", cpu=True, log_policy=False)
    model = Model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(MixprecDtypeError):
        model(torch.randn(4, 8))
    model.encoder.layers[1].block.double_input = False
    acc.backward(model(torch.randn(4, 8)).float().pow(2).mean())
    assert opt.step().stepped
    assert not torch.is_autocast_enabled("cpu")  # the failed forward left autocast off
