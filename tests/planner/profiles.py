"""Synthetic profiles whose costs are straight lines, so that simulated times can be worked out by hand."""

from __future__ import annotations

from cluster.planner.profile import Grid, Profile

WIDE = [0, 100_000]  # context columns: the costs below do not depend on context


def linear_profile(*, step_s: float = 0.01, prefill_per_token_s: float = 0.001, decode_per_row_s: float = 0.001,
                   transfer_per_token_s: float = 0.0) -> Profile:
    """prefill(t) = step_s + t * prefill_per_token_s; decode(b) = step_s + b * decode_per_row_s;
    transfer(n tokens) = n * transfer_per_token_s (one byte per token)."""
    prefill = [step_s + tokens * prefill_per_token_s for tokens in (1, 100_000)]
    decode = [step_s + batch * decode_per_row_s for batch in (1, 1_000)]
    return Profile(prefill=Grid([1, 100_000], WIDE, [[value, value] for value in prefill]),
                   decode=Grid([1, 1_000], WIDE, [[value, value] for value in decode]),
                   transfer_bytes=[0, 100_000], transfer_seconds=[0.0, 100_000 * transfer_per_token_s],
                   kv_bytes_per_token=1, model="synthetic", dtype="float32", threads=1)
