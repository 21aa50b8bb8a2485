"""The one helper behind the choice lists of algorithms/: a plain name -> function dict, kept in the module
that owns the functions (ADVANTAGES, POLICY_LOSSES, AGGREGATIONS, CORRECTIONS; KL_ESTIMATORS, three
one-line formulas, is a dict literal) and read by dispatch and by config validation alike, so a name is
written once. `register` only fills the dict; nothing is bound at run time: a call site reads
TABLE[name](...), and an unknown name is a KeyError naming it.
"""

from __future__ import annotations

from typing import Callable


def register(table: dict[str, Callable], name: str) -> Callable[[Callable], Callable]:
    """`@register(TABLE, "name")` above a function adds it to TABLE under `name`; the function is unchanged."""
    def add(fn: Callable) -> Callable:
        assert name not in table, f"'{name}' is registered twice"
        table[name] = fn
        return fn
    return add
