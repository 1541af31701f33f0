"""What a checkpoint's step is (:data:`STEP_RULE`), and the words for ranks that give no step or
different ones: shared by :meth:`~hpcsync.resilience.checkpoint.Checkpoints.save` and ``load``."""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

from ..core.errors import ranks_by_value
from ..core.nodemap import ranges

__all__ = ["STEP_RULE", "as_step", "said", "who", "step_problem"]

STEP_RULE = "a step is a non-negative integer (an int, or an integer scalar of numpy or torch; not a bool)"


def as_step(step: Any) -> Optional[int]:
    """``step`` as the int a checkpoint is saved under, or None when it is no step: a step is a
    non-negative integer -- an int, or anything ``operator.index`` takes (numpy's and torch's
    integer scalars) -- but never a bool (``True`` is no step 1)."""
    if isinstance(step, bool) or "bool" in str(getattr(step, "dtype", "")):
        return None
    try:
        number = operator.index(step)
    except TypeError:
        return None
    return number if number >= 0 else None


def said(step: Any) -> str:
    """How an error names a step that is none: its repr (cut short) and its type."""
    text = repr(step)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(step).__name__})"


def who(ranks: List[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {ranges(ranks)}"


def step_problem(every: List[Tuple[Any, Optional[str]]], verb: str) -> Optional[str]:
    """Why the ranks' steps (each ``(step, None)``, or ``(None, how a step that is none reads)``)
    are not one step, or None."""
    bad: Dict[str, List[int]] = {}
    for r, (_, said) in enumerate(every):
        if said is not None:
            bad.setdefault(said, []).append(r)
    if bad:
        return STEP_RULE + ": " + "; ".join(f"{who(rs)}: {s}" for s, rs in bad.items())
    steps = ranks_by_value([n for n, _ in every])
    if len(steps) > 1:
        return (f"the ranks gave different steps (every rank {verb} the same step): "
                + "; ".join(f"{who(rs)}: {'the latest' if n is None else n}" for n, rs in steps.items()))
    return None
