"""Methods, selectable by name: APG and the baselines, all with the sampler's interface.

A method says which architecture of a task's proposals it trains and how it spends a
sample budget of K sweeps x L particles. A new method is one module here plus one line
in ``METHODS``.
"""

from __future__ import annotations

from apg.baselines.avf import AVF
from apg.baselines.gibbs import BootstrapGibbs, ExactGibbs
from apg.baselines.hmc import HMCRWS
from apg.baselines.method import APG, Method
from apg.baselines.reparam import Reparam
from apg.baselines.rws import RWS

METHODS: dict[str, Method] = {
    "apg": APG(),
    "rws-mlp": RWS("rws-mlp", "mlp"),
    "rws-lstm": RWS("rws-lstm", "lstm"),
    "gibbs": ExactGibbs(),
    "gibbs-bootstrap": BootstrapGibbs(),
    "hmc-rws": HMCRWS(),
    "reparam": Reparam(),
    "avf": AVF(),
}


def get_method(name: str) -> Method:
    """The method registered as ``name``; raises ``ValueError`` for unknown names."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}") from None


__all__ = ["METHODS", "Method", "get_method"]
