"""How a simulated run agrees with a measured one, request by request (the validation's second view).

Percentiles can agree while the model queues the wrong requests (or disagree only because of a few):
pairing each request's measured TTFT with its own simulated one shows which. Standard library only.
"""

from __future__ import annotations

import statistics
from typing import Any


def ranks(values: list[float]) -> list[int]:
    """Each value's place in ascending order (0 for the smallest; ties in their given order)."""
    places = [0] * len(values)
    for place, index in enumerate(sorted(range(len(values)), key=values.__getitem__)):
        places[index] = place
    return places


def per_request_agreement(measured: dict[str, float], simulated: dict[str, float]) -> dict[str, Any]:
    """Over the requests in both (by id, in `measured`'s order): the median error of simulated over
    measured, the share within 25%, and the rank correlation (Spearman's: whether the model puts the
    same requests behind the same others)."""
    ids = [request_id for request_id in measured if request_id in simulated]
    if len(ids) < 2:
        return {"requests": len(ids)}
    real, model = [measured[i] for i in ids], [simulated[i] for i in ids]
    errors = [m / r - 1 for r, m in zip(real, model, strict=True)]
    return {"requests": len(ids), "median_error": statistics.median(errors),
            "within_25pct": sum(abs(error) <= 0.25 for error in errors) / len(errors),
            "rank_correlation": statistics.correlation(ranks(real), ranks(model))}
