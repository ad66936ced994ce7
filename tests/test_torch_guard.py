"""`import mixprec` refuses a torch other than the one mixprec._C was compiled against
(src/mixprec/_torch_guard.py). Nothing is rebuilt: each case runs `import mixprec` in a fresh
interpreter with the recorded build version (mixprec._build_torch) replaced in sys.modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from mixprec import _torch_guard


def _import_with_record(version, cuda, env=None):
    code = textwrap.dedent(f"""
        import sys, types, warnings
        record = types.ModuleType("mixprec._build_torch")
        record.TORCH_VERSION = {version!r}
        record.TORCH_CUDA = {cuda!r}
        sys.modules["mixprec._build_torch"] = record
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            try:
                import mixprec
            except ImportError as error:
                print("ERROR", type(error).__name__, error)
                print("LOADED_C", "mixprec._C" in sys.modules)
                raise SystemExit(3)
        for w in caught:
            print("WARNING", w.category.__name__, w.message)
        print("OK", mixprec.Accelerator.__name__)
    """)
    import os

    full_env = {k: v for k, v in os.environ.items() if k != _torch_guard.OVERRIDE_ENV}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=full_env)


def test_the_installed_build_matches_the_running_torch():
    from mixprec import _build_torch

    assert _build_torch.TORCH_VERSION == torch.__version__
    assert _build_torch.TORCH_CUDA == torch.version.cuda
    assert dict(__import__("mixprec").build_info())["torch_version"] == _build_torch.TORCH_VERSION


def test_another_release_is_an_import_error_naming_both_and_the_rebuild():
    out = _import_with_record("2.11.0+cu130", "13.0")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "ERROR TorchMismatchError" in out.stdout
    assert "built against torch 2.11.0+cu130 (CUDA 13.0)" in out.stdout
    assert f"torch {torch.__version__} (CPU) is installed" in out.stdout
    assert "pip install --no-build-isolation --force-reinstall" in out.stdout
    assert _torch_guard.OVERRIDE_ENV in out.stdout
    assert "LOADED_C False" in out.stdout  # refused before the extension was loaded


def test_same_release_other_cuda_flavour_is_refused():
    release = torch.__version__.split("+")[0]
    out = _import_with_record(f"{release}+cu130", "13.0")
    assert out.returncode == 3 and "(CUDA 13.0)" in out.stdout, out.stdout + out.stderr


def test_the_override_downgrades_the_error_to_a_warning():
    out = _import_with_record("2.11.0+cu130", "13.0", env={_torch_guard.OVERRIDE_ENV: "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING RuntimeWarning mixprec's compiled core" in out.stdout
    assert "OK Accelerator" in out.stdout


@pytest.mark.parametrize("built,running,equal", [
    (("2.13.0+cpu", None), ("2.13.0", None), True),  # the local label is not the ABI
    (("2.13.0+cpu", None), ("2.13.1+cpu", None), False),
    (("2.13.0+cu130", "13.0"), ("2.13.0+cu128", "12.8"), False),
    (("2.13.0", None), ("2.13.0+cu130", "13.0"), False),
])
def test_what_counts_as_the_same_torch(built, running, equal):
    assert (_torch_guard.mismatch(*built, *running) is None) == equal


# ------------------------------------------------------------------ the wheel's metadata
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _provider():
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_pin", ROOT / "build_support" / "torch_pin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_metadata_provider_pins_torch_for_a_wheel_and_keeps_the_range_for_an_sdist():
    pin = _provider()
    release = torch.__version__.split("+")[0]
    wheel = pin.dynamic_metadata("dependencies", {})
    assert f"torch=={release}" in wheel and not any(r.startswith("torch>") for r in wheel)
    sdist = pin.dynamic_metadata("dependencies", {"pin-torch": "no"})
    assert sdist == pin.REQUIRES and any(r.startswith("torch>=") for r in sdist)
    assert [r for r in wheel if not r.startswith("torch")] == [r for r in sdist if not r.startswith("torch")]
    with pytest.raises(ValueError, match="provides 'dependencies', not 'version'"):
        pin.dynamic_metadata("version", {})


@pytest.mark.slow
def test_a_wheel_built_here_declares_the_exact_torch_it_was_built_against(tmp_path):
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                          str(ROOT), "-w", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (wheel,) = tmp_path.glob("mixprec-*.whl")
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        record = z.read("mixprec/_build_torch.py").decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
                if line.startswith("Requires-Dist: torch")]
    assert requires == [f"torch=={torch.__version__.split('+')[0]}"], requires
    assert f'TORCH_VERSION = "{torch.__version__}"' in record
