"""A pytest plugin for tests/test_fp16_paths.py's reruns (``-p _fp16_path_plugin``): every
fp16 product of a prepared model takes the path ``MIXPREC_CPU_FP16_MATMUL`` names, however
small (``half_gemm.MIN_WORK`` = 0: the fp16 tests' models are tiny, and below the threshold
both settings leave the product to torch), and the number of widened GEMMs run is written
to ``MIXPREC_FP16_PATH_REPORT`` at the end, so the runner can tell that the path ran."""

import os

from mixprec.wrappers import half_gemm

half_gemm.MIN_WORK = 0
_CALLS = [0]
_apply = half_gemm._WidenedGemm.apply


def _counted(*args):
    _CALLS[0] += 1
    return _apply(*args)


half_gemm._WidenedGemm.apply = _counted


def pytest_sessionfinish(session, exitstatus):
    report = os.environ.get("MIXPREC_FP16_PATH_REPORT")
    if report:
        with open(report, "w") as f:
            f.write(str(_CALLS[0]))
