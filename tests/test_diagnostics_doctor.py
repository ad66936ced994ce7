"""Acceptance (issue #8): ``mixprec.doctor()`` lists mixed-dtype modules, uncast buffers, ops
without low-precision kernels, non-finite outputs and a forward dtype error with its path,
and leaves the user's model untouched."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Accelerator, doctor


class Centers(nn.Module):
    """Distances to learned centres: torch.cdist has no bf16/fp16 kernel on the CPU."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.centers = nn.Parameter(torch.randn(3, dim))

    def forward(self, x):
        return torch.cdist(x.float(), self.centers)


class Net(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm1d(dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.dist = Centers(dim)

    def forward(self, x, scale: float = 1.0):
        return self.dist(self.body(self.bn(x)) * scale)


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [p.grad for p in model.parameters()], type(model), model.training)


def test_doctor_finds_mixed_dtypes_buffers_and_missing_kernels_without_touching_the_model():
    model = Net()
    model.body[2].weight.data = model.body[2].weight.data.half()  # a manual half on one weight
    before = _snapshot(model)
    batch = torch.randn(4, 8)
    rng = torch.get_rng_state()
    report = doctor(model, batch, mixed_precision="bf16", device="cpu")

    mixed = report.of_kind("mixed_param_dtypes")
    assert [f.module for f in mixed] == ["body.2"]
    assert mixed[0].details["dtypes"] == {"weight": "fp16", "bias": "fp32"}
    buffers = report.of_kind("uncast_buffers")
    assert [f.module for f in buffers] == ["bn"]
    assert buffers[0].details["dtypes"] == {"running_mean": "fp32", "running_var": "fp32"}
    assert "running statistics" in buffers[0].message
    missing = {f.details["op"]: f for f in report.of_kind("no_lowp_kernel")}
    assert "_cdist_forward" in missing and missing["_cdist_forward"].module == "dist"
    assert "not implemented for 'BFloat16'" in missing["_cdist_forward"].message
    assert "native_batch_norm" in report.of_kind("fp32_ops")[0].details["ops"]
    assert not report.of_kind("dtype_error") and not report.of_kind("forward_error")
    assert not report.ok and "mixed_param_dtypes" in str(report) and "mixed_precision='bf16'" in str(report)

    state, grads, cls, training = _snapshot(model)
    assert all(torch.equal(before[0][k], v) for k, v in state.items())  # weights and BN stats
    assert grads == [None] * len(grads) and cls is Net and training == before[3]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch.equal(rng, torch.get_rng_state())
    assert model.body[2].weight.dtype == torch.float16  # nothing was cast on the user's model


def test_doctor_reports_a_forward_dtype_error_with_its_path_instead_of_raising():
    class Stray(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x.double())

    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), Stray()))
    report = doctor(model, (torch.randn(2, 8),), mixed_precision="bf16", device="cpu")
    [finding] = report.of_kind("dtype_error")
    assert finding.severity == "error" and finding.module == "1.1.proj"
    assert finding.details["inputs"] == {"input": "float64"}
    assert finding.details["params"] == {"weight": "fp32", "bias": "fp32"}
    assert "must have the same dtype" in finding.message and "cast the float64 input" in finding.fix


def test_doctor_names_the_module_whose_fp16_output_overflows_and_takes_kwargs():
    class Amplify(nn.Module):
        def forward(self, x):
            return x * 1e6

    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.amp = Amplify()
            self.out = nn.Linear(8, 2)

        def forward(self, x, bias=None):
            return self.out(self.amp(self.inp(x)) + bias)

    torch.manual_seed(0)
    report = doctor(Net2(), {"x": torch.randn(4, 8), "bias": torch.zeros(8)}, mixed_precision="fp16",
                    device="cpu")
    found = report.of_kind("nonfinite_output")
    assert [f.module for f in found] == ["amp"]  # where it starts, not the modules after/around it
    assert found[0].details["dtype"] == "fp16" and found[0].details["nonfinite"] > 0
    assert "keep_fp32_modules=['amp']" in found[0].fix


def test_doctor_on_a_clean_model_is_ok_and_reports_other_errors():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    report = doctor(model, torch.randn(4, 8), mixed_precision="bf16", device="cpu")
    assert report.ok, str(report)
    report = doctor(model, torch.randn(4, 5), mixed_precision="no", device="cpu")
    [finding] = report.of_kind("forward_error")
    assert finding.module == "0" and "cannot be multiplied" in finding.message


def test_doctor_refuses_a_prepared_model_and_bad_arguments():
    acc = Accelerator(cpu=True, log_policy=False)
    model = acc.prepare(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"already wrapped; run doctor on the model before prepare"):
        doctor(model, torch.randn(1, 2))
    with pytest.raises(ValueError, match=r"mixed_precision='fp8' is not supported"):
        doctor(nn.Linear(2, 2), torch.randn(1, 2), mixed_precision="fp8")
    with pytest.raises(TypeError, match=r"needs a torch.nn.Module, got str"):
        doctor("model", torch.randn(1, 2))
    assert mixprec.doctor is doctor
