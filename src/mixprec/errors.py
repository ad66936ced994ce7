"""Exceptions raised by mixprec.

User-caused problems raise ``ValueError``/``TypeError`` subclasses that echo the bad
value and name the fix; problems found while training raise ``MixprecError``.
"""


class MixprecError(RuntimeError):
    """A training-time problem mixprec detected (with what to do about it)."""


class UnscaledBackwardError(MixprecError):
    """fp16 gradients were produced by a backward that never went through the loss scaler."""


class MixprecDtypeError(MixprecError):
    """A dtype error raised inside a prepared model's forward, re-raised naming the module.

    It is a ``RuntimeError`` (like the torch error it wraps, kept as ``__cause__``), so an
    existing ``except RuntimeError`` still catches it. Attributes: ``module_path`` (dotted
    name in the prepared model, ``""`` for the root), ``module_type``, ``param_dtypes`` and
    ``buffer_dtypes`` (name -> dtype), ``input_dtypes`` (local name -> dtype), ``policy``
    (the active policy's one-line description), ``fixes`` (suggestions, most likely first)
    and ``original`` (the torch message).
    """

    def __init__(self, message: str, *, module_path: str = "", module_type: str = "",
                 param_dtypes: dict | None = None, buffer_dtypes: dict | None = None,
                 input_dtypes: dict | None = None, policy: str = "", fixes: tuple = (),
                 original: str = "") -> None:
        super().__init__(message)
        self.module_path = module_path
        self.module_type = module_type
        self.param_dtypes = dict(param_dtypes or {})
        self.buffer_dtypes = dict(buffer_dtypes or {})
        self.input_dtypes = dict(input_dtypes or {})
        self.policy = policy
        self.fixes = tuple(fixes)
        self.original = original


class OverflowStormError(MixprecError):
    """fp16 overflowed ``max_consecutive_overflows`` optimizer steps in a row: training was
    stopped (every one of those steps was skipped, so the weights are those of the last good
    step). ``report`` is a :class:`mixprec.diagnostics.OverflowReport` naming the first
    module whose output or gradient became non-finite, and the fixes."""

    def __init__(self, message: str, report=None) -> None:
        super().__init__(message)
        self.report = report


class UnshardedParameterError(MixprecError):
    """zero3/fsdp: a parameter was read while its sharding unit was not gathered (torch's
    "data is not allocated yet"), re-raised naming the module that read it, the parameter,
    its unit and the fix. ``module_path``, ``params`` (names) and ``units`` (names) say which."""

    def __init__(self, message: str, *, module_path: str = "", params: tuple = (), units: tuple = ()) -> None:
        super().__init__(message)
        self.module_path = module_path
        self.params = tuple(params)
        self.units = tuple(units)


class UnitOrderError(MixprecError):
    """zero3/fsdp: the ranks gathered different sharding units at the same point (a unit that
    only some ranks call), detected before any parameter data was exchanged. ``mine`` and
    ``theirs`` (rank -> unit name) say which."""

    def __init__(self, message: str, *, mine: str = "", theirs: dict | None = None) -> None:
        super().__init__(message)
        self.mine = mine
        self.theirs = dict(theirs or {})


class NonFiniteGradientsError(MixprecError):
    """``nonfinite_grads: raise``: an optimizer step found inf/nan gradients (bf16/fp32; on
    any rank, every rank raises). Nothing was updated. ``step`` is the 1-based number of
    that optimizer's ``step()`` call."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class CollectiveMismatchError(MixprecError):
    """Ranks did not all make the same collective call (src/mixprec/checkpoint/sync.py)."""


class CollectiveDesyncError(CollectiveMismatchError):
    """Ranks made different collective calls, passed tensors of different shapes, or one
    did not arrive ([Note: desync detection] in src/mixprec/distributed/watchdog.py)."""


class NotPreparedError(MixprecError):
    """``accelerator.backward(loss)`` (or ``scale``) was called before ``prepare()`` got a
    model: the gradient would land in plain ``.grad`` tensors, outside the engine, and flow
    into the first real optimizer step (scaled by 65536 in fp16)."""


class PeerFailedError(MixprecError):
    """Under ``mixprec launch``, another rank (possibly on another node) failed first; its
    exception was published through the rendezvous store and is quoted in the message
    (src/mixprec/launch.py, [Note: failures across nodes])."""
