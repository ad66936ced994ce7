"""The CI compile checks' refusal logic (.ci/torch_headers_check.sh, .ci/cuda_compile_check.sh,
build_support/compile_checks.sh, build_support/fatbin_archs.py), without downloading or
compiling anything: the package index is an unreachable local port."""

import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TORCH_DIR = Path(torch.__file__).resolve().parent
sys.path.insert(0, str(ROOT / "build_support"))
from fatbin_archs import fatbin_archs  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the checks are bash scripts")


def _offline_env(tmp_path):
    env = dict(os.environ)
    env.update({
        "MIXPREC_TORCH_HEADERS_CACHE": str(tmp_path / "cache"),
        "MIXPREC_COMPAT_LOGS": str(tmp_path / "logs"),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # nothing listens on port 9
        "PIP_CONFIG_FILE": os.devnull,  # no extra indexes or find-links from the machine's config
        "PIP_FIND_LINKS": "",
        "PIP_RETRIES": "0",
        "PIP_DEFAULT_TIMEOUT": "5",
        "PYTHON": sys.executable,
    })
    return env


def _run(args, env, timeout=120):
    return subprocess.run(["bash", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # runs the scripts: pip and a torch import, seconds
def test_a_release_that_cannot_be_fetched_fails_the_check(tmp_path):
    env = _offline_env(tmp_path)
    out = _run([".ci/torch_headers_check.sh", "--fetch", "9.99.0"], env)
    assert out.returncode != 0 and out.stdout == ""
    assert "cannot fetch torch 9.99.0" in out.stderr and "no cached copy" in out.stderr
    assert "http://127.0.0.1:9/simple/torch/ cannot be read" in out.stderr
    out = _run([".ci/torch_headers_check.sh", "9.99.0"], env)
    assert out.returncode == 1, out.stdout
    assert "FAIL: torch headers check: 9.99.0 (not fetched)" in out.stdout
    assert "PASS" not in out.stdout and "skipped" not in out.stdout


def _cache_copy(tmp_path, version, share=True):
    dest = tmp_path / "cache" / version / "torch"
    dest.mkdir(parents=True)
    (dest / "include").symlink_to(TORCH_DIR / "include")
    if share:
        (dest / "share").symlink_to(TORCH_DIR / "share")
    return dest


def test_a_cached_copy_is_used_without_the_network(tmp_path):
    dest = _cache_copy(tmp_path, "9.99.0")
    out = _run([".ci/torch_headers_check.sh", "--fetch", "9.99.0"], _offline_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(dest / "include")


def test_a_cache_without_torchs_cmake_config_is_fetched_again(tmp_path):
    # The compile definitions (USE_DISTRIBUTED, ...) come from share/cmake: a cached copy
    # holding only include/ is incomplete, and fetching it again offline fails.
    _cache_copy(tmp_path, "9.99.0", share=False)
    out = _run([".ci/torch_headers_check.sh", "--fetch", "9.99.0"], _offline_env(tmp_path))
    assert out.returncode != 0 and "predates torch/share/cmake" in out.stderr


@pytest.mark.slow  # runs the scripts: pip and a torch import, seconds
def test_cuda_check_fails_without_cuda_headers(tmp_path):
    nvcc = tmp_path / "nvcc"  # enough for build_support/cuda_archs.cmake
    nvcc.write_text("#!/bin/sh\necho sm_75 sm_80 sm_86 sm_89 sm_90 sm_100 sm_120\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    env = _offline_env(tmp_path)
    env["NVCC"] = str(nvcc)
    out = _run([".ci/cuda_compile_check.sh"], env)
    assert out.returncode == 1
    assert "FAIL: no CUDA torch" in out.stdout and "cannot fetch torch" in out.stdout
    assert "PASS" not in out.stdout


def _lib(call):
    out = subprocess.run(["bash", "-c", f"source build_support/compile_checks.sh && {call}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    return out


def test_torch_defines_come_from_torchs_cmake_config():
    out = _lib(f"torch_defines {TORCH_DIR}")
    assert out.returncode == 0, out.stderr
    defines = out.stdout.split()
    assert "-DUSE_DISTRIBUTED" in defines and "-DUSE_C10D_GLOO" in defines
    assert (TORCH_DIR / "share/cmake/Caffe2/Caffe2Targets.cmake").read_text().count("USE_C10D_GLOO")
    out = _lib(f"torch_defines {TORCH_DIR / 'include'}")  # not a torch root
    assert out.returncode != 0 and "cannot read torch's compile definitions" in out.stderr


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the capabilities are x86's")
def test_the_simd_variants_use_cmakes_flags():
    assert _lib("cpu_caps").stdout.split() == ["AVX2", "AVX512"]
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for cap in ("AVX2", "AVX512"):
        flags = _lib(f"cpu_cap_flags {cap}").stdout.strip()
        assert flags.startswith("-m") and f"set(MIXPREC_CPU_FLAGS_{cap} {flags})" in cmake
    out = _lib("cpu_cap_flags SSE9")
    assert out.returncode != 0 and "MIXPREC_CPU_FLAGS_SSE9" in out.stderr


def test_gencode_flags_follow_cmakes_entries():
    out = _lib("gencode_flags 75-real 120 90-virtual")
    assert out.stdout.split("\n")[:6] == [
        "-gencode", "arch=compute_75,code=sm_75",
        "-gencode", "arch=compute_120,code=[sm_120,compute_120]",
        "-gencode", "arch=compute_90,code=compute_90"]


def _fatbin(entries):
    body = b""
    for kind, arch, payload in entries:
        header = struct.pack("<HHIQ", kind, 0x0101, 64, len(payload)) + bytes(12)
        header += struct.pack("<I", arch) + bytes(64 - 32)
        body += header + payload
    return b"junk" + struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body + b"tail"


def test_fatbin_reader_lists_machine_code_and_ptx():
    blob = _fatbin([(2, 90, b"\0" * 40), (1, 120, b"ptx text"), (2, 75, b"\1" * 8)])
    assert fatbin_archs(blob) == ["sm_75", "sm_90", "compute_120"]
    assert fatbin_archs(b"no fat binary here") == []
    with pytest.raises(ValueError, match="unexpected fat binary entry"):
        fatbin_archs(_fatbin([(7, 90, b"")]))
