"""One process, one device: the precision layer with no communication."""

from __future__ import annotations

from .comm import Comm


class SingleComm(Comm):
    """``backend="single"``: everything local. The contract's defaults (engines/comm.py)
    already describe it; this class exists so backends are chosen by name, never by
    ``if`` chains."""

    name = "single"
