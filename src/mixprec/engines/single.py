"""One process, one device: the precision machinery with no communication."""

from __future__ import annotations

from .base import Engine


class SingleEngine(Engine):
    """``backend="single"``: everything local. The base class already does all the work;
    this class exists so backends are chosen by name, never by ``if`` chains."""

    name = "single"
    replicated_state = True
