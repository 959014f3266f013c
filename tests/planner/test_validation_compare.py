"""The validation's per-request comparison (`cluster.planner.accuracy`), on a case worked out by hand."""

from __future__ import annotations

import pytest

from cluster.planner.accuracy import per_request_agreement, ranks


def test_each_requests_ttft_is_paired_by_id_with_its_simulated_one():
    # Measured 0.1, 0.2, 0.4 s (listed out of order, as requests finish); simulated 0.1, 0.22, 0.2,
    # and one request only simulated (it failed when measured): errors 0, +10%, -50% (median 0, two of
    # three within 25%); ranks 0,1,2 against 0,2,1: Spearman's 1 - 6 x (0 + 1 + 1) / (3 x 8) = 0.5.
    measured = {"r2": 0.4, "r0": 0.1, "r1": 0.2}
    simulated = {"r0": 0.1, "r1": 0.22, "r2": 0.2, "r3": 9.0}
    agreement = per_request_agreement(measured, simulated)
    assert agreement["requests"] == 3
    assert (agreement["median_error"], agreement["within_25pct"], agreement["rank_correlation"]) == \
        pytest.approx((0.0, 2 / 3, 0.5))
    assert ranks([0.4, 0.1, 0.2]) == [2, 0, 1]
