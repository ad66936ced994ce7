"""Diagnostics: dtype errors that name the module, the fp16 overflow-storm stop, and
``doctor()``, a one-step dry run that lists what mixed precision will do to a model.

Example::

    report = mixprec.doctor(model, batch, mixed_precision="bf16")
    print(report)
    [f.kind for f in report.findings]
"""

from .doctor import DoctorReport, Finding, doctor
from .dtype_errors import explain_dtype_error, is_dtype_error
from .overflow import OverflowReport, OverflowWatch
from .probes import FP16_MAX, ModuleProbes, TensorStat

__all__ = [
    "FP16_MAX",
    "DoctorReport",
    "Finding",
    "ModuleProbes",
    "OverflowReport",
    "OverflowWatch",
    "TensorStat",
    "doctor",
    "explain_dtype_error",
    "is_dtype_error",
]
