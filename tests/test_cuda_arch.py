"""The GPU check when an engine is built (src/mixprec/cuda_arch.py) and the arch list the build picks
(build_support/cuda_archs.cmake), on CPU: the GPU and the compiled archs are faked."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec import cuda_arch
from mixprec.cuda_arch import UnsupportedGPUError, kernel_image_for, parse_archs
from mixprec.engines.base import Engine
from mixprec.policy import PrecisionPolicy

ROOT = Path(__file__).resolve().parents[1]
OLD_DEFAULT = ["80", "90"]  # CMake's plain entries: SASS + PTX each (the build before AUTO)
AUTO_13 = ["75-real", "80-real", "86-real", "89-real", "90-real", "100-real", "120"]  # nvcc 13.0
AUTO_12_6 = ["75-real", "80-real", "86-real", "89-real", "90"]  # nvcc 12.0-12.7 stop at sm_90


def test_the_extension_reports_its_archs():
    info = mixprec.build_info()
    assert isinstance(info["cuda_archs"], list)
    if info["cuda"]:
        assert info["cuda_archs"] and parse_archs(info["cuda_archs"])[0]
    else:
        assert info["cuda_archs"] == []


def test_entries_parse_into_machine_code_and_ptx():
    assert parse_archs(["75-real", "90a-real", "100f", "120-virtual"]) == (
        [(7, 5, ""), (9, 0, "a"), (10, 0, "f")], [(10, 0, "f"), (12, 0, "")])
    for bad in ("native", "sm_80", "8.0", "all-major", "80-fake"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_archs([bad])


@pytest.mark.parametrize("cap,archs,expected", [
    ((7, 5), AUTO_13, "sm_75"),  # T4
    ((8, 0), AUTO_13, "sm_80"),  # A100
    ((8, 6), AUTO_13, "sm_86"),  # A10 / RTX 3090
    ((8, 7), AUTO_13, "sm_86"),  # Orin: 8.6 machine code runs on 8.7
    ((8, 9), AUTO_13, "sm_89"),  # L4 / RTX 4090
    ((9, 0), AUTO_13, "sm_90"),  # H100 / H200
    ((10, 0), AUTO_13, "sm_100"),  # B200
    ((10, 3), AUTO_13, "sm_100"),  # B300
    ((12, 0), AUTO_13, "sm_120"),  # RTX 5090
    ((12, 1), AUTO_13, "sm_120"),  # GB10
    ((13, 0), AUTO_13, "compute_120 (PTX, compiled by the driver)"),  # a later GPU
    ((11, 0), AUTO_13, None),  # Thor: major 11 has no code, PTX 12.0 is newer than it
    ((10, 0), AUTO_12_6, "compute_90 (PTX, compiled by the driver)"),  # a CUDA 12.6 build
    ((7, 5), OLD_DEFAULT, None),  # the issue: T4 under the old 80;90
    ((8, 9), OLD_DEFAULT, "sm_80"),
    ((12, 0), OLD_DEFAULT, "compute_90 (PTX, compiled by the driver)"),
    ((7, 5), ["80-real", "90-real"], None),
    ((10, 0), ["80-real", "90-real"], None),  # no PTX: nothing for a newer major
    ((9, 0), ["90a-real"], "sm_90a"),
    ((10, 0), ["90a"], None),  # arch-specific PTX runs only on 9.0
    ((10, 3), ["100f-real"], "sm_100f"),
    ((12, 0), ["100f"], None),  # family PTX: same major only
])
def test_which_image_a_gpu_runs(cap, archs, expected):
    assert kernel_image_for(archs, cap) == expected


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA build holding `archs`, and one GPU of capability `cap` named `name`."""

    def install(cap, name, archs, has_cuda=True):
        monkeypatch.setattr(cuda_arch, "compiled_archs", lambda: (has_cuda, list(archs)))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    return install


def test_a_t4_is_refused_with_its_name_capability_and_the_build_option(fake_gpu):
    fake_gpu((7, 5), "Tesla T4", OLD_DEFAULT)
    with pytest.raises(UnsupportedGPUError) as err:
        cuda_arch.check_device(torch.device("cuda", 0))
    msg = str(err.value)
    assert "cuda:0 (Tesla T4, compute capability 7.5)" in msg
    assert "sm_80, sm_90, PTX compute_80, PTX compute_90" in msg
    assert 'MIXPREC_CUDA_ARCHS="80;90;75"' in msg and "fused_optimizer=False" in msg
    assert isinstance(err.value, mixprec.MixprecError)


def test_covered_gpus_pass_and_say_how(fake_gpu):
    fake_gpu((8, 9), "NVIDIA L4", AUTO_13)
    assert cuda_arch.check_device(torch.device("cuda")) == "sm_89"
    fake_gpu((13, 0), "a GPU from the future", AUTO_13)
    assert cuda_arch.check_device(torch.device("cuda", 0)).startswith("compute_120 (PTX")


def test_a_build_without_cuda_kernels_is_refused(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H200", [], has_cuda=False)
    with pytest.raises(UnsupportedGPUError, match=r"no CUDA kernels .*MIXPREC_CUDA=ON"):
        cuda_arch.check_device(torch.device("cuda", 0))


def test_engine_refuses_the_gpu_before_touching_it(fake_gpu):
    # The call site: Engine.__init__ (src/mixprec/engines/base.py), which Accelerator(...) builds.
    fake_gpu((7, 5), "Tesla T4", OLD_DEFAULT)
    with pytest.raises(UnsupportedGPUError, match=r"Tesla T4, compute capability 7\.5"):
        Engine(PrecisionPolicy.from_mixed_precision("bf16"), torch.device("cuda", 0))
    with pytest.raises(ValueError, match="not a CUDA device"):
        cuda_arch.check_device(torch.device("cpu"))


def test_engine_without_fused_steps_does_not_check(fake_gpu, monkeypatch):
    # Only the fused steps launch mixprec's kernels: fused_optimizer=False steps with torch's
    # optimizers, so the engine does not ask (on this CPU machine it then fails on CUDA itself).
    calls = []
    monkeypatch.setattr(cuda_arch, "check_device", lambda device: calls.append(device))
    fake_gpu((7, 5), "Tesla T4", OLD_DEFAULT)
    with pytest.raises(Exception) as err:
        Engine(PrecisionPolicy.from_mixed_precision("bf16"), torch.device("cuda", 0), fused_optimizer=False)
    assert calls == [] and not isinstance(err.value, UnsupportedGPUError)
    with pytest.raises(Exception):
        Engine(PrecisionPolicy.from_mixed_precision("bf16"), torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]


# ---- build_support/cuda_archs.cmake: the list AUTO resolves to -----------------------

def _fake_nvcc(tmp_path, codes):
    path = tmp_path / "nvcc"
    path.write_text("#!/bin/sh\n[ \"$1\" = --list-gpu-code ] || exit 1\n"
                    + "".join(f"echo sm_{c}\n" for c in codes))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _resolve(nvcc, archs="AUTO"):
    cmake = shutil.which("cmake")
    assert cmake, "cmake builds mixprec; it must be on PATH"
    return subprocess.run([cmake, f"-DNVCC={nvcc}", f"-DMIXPREC_CUDA_ARCHS={archs}", "-P",
                           str(ROOT / "build_support" / "cuda_archs.cmake")],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("codes,expected", [
    # CUDA 13.0's list (sm_110, 103, 121 are not in the generations: covered as shown above)
    ([75, 80, 86, 87, 88, 89, 90, 100, 110, 103, 120, 121], AUTO_13),
    ([50, 52, 60, 61, 70, 75, 80, 86, 87, 89, 90], AUTO_12_6),  # CUDA 12.6
    ([50, 60, 70, 75, 80, 86, 89, 90, 100, 101, 120], AUTO_13),  # CUDA 12.8
])
def test_auto_builds_every_generation_nvcc_has_with_ptx_for_the_newest(tmp_path, codes, expected):
    out = _resolve(_fake_nvcc(tmp_path, codes))
    assert out.returncode == 0, out.stderr
    archs = out.stdout.strip().split(";")
    assert archs == expected
    for cap in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0)]:  # every current generation runs
        assert kernel_image_for(archs, cap) == f"sm_{cap[0]}{cap[1]}"


def test_explicit_lists_are_checked_against_nvcc(tmp_path):
    nvcc = _fake_nvcc(tmp_path, [75, 80, 86, 89, 90, 100, 120])
    out = _resolve(nvcc, "89;90a-real")
    assert out.returncode == 0 and out.stdout.strip() == "89;90a-real"
    out = _resolve(nvcc, "70;80")
    assert out.returncode != 0 and "entry '70'" in out.stderr and "cannot" in out.stderr
    out = _resolve(nvcc, "native")
    assert out.returncode != 0 and "'native' is not a compute capability" in out.stderr
