"""Exceptions raised by mixprec.

User-caused problems raise ``ValueError``/``TypeError`` subclasses that echo the bad
value and name the fix; problems found while training raise ``MixprecError``.
"""


class MixprecError(RuntimeError):
    """A training-time problem mixprec detected (with what to do about it)."""


class UnscaledBackwardError(MixprecError):
    """fp16 gradients were produced by a backward that never went through the loss scaler."""
