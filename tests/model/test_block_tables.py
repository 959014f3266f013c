"""The runner's persistent block tables mirror the KV cache manager's lists exactly."""

from __future__ import annotations

import numpy as np

from cluster.common.sampling_params import SamplingParams
from cluster.engine.request import Request
from cluster.engine.scheduler_output import ScheduledRequest
from cluster.model.runner import BlockTables


def scheduled(request_id: str, block_ids: list[int]) -> ScheduledRequest:
    return ScheduledRequest(Request(request_id, [1], SamplingParams()), 1, block_ids, True)


def test_rows_follow_growth_replacement_and_release() -> None:
    tables = BlockTables(max_blocks_per_request=8, rows=2)
    lists = {f"r{i}": [i, i + 100] for i in range(5)}  # more requests than rows: the table grows
    rows = tables.rows_for([scheduled(k, v) for k, v in lists.items()])
    for row, block_ids in zip(rows, lists.values(), strict=True):
        assert tables.table[row, :len(block_ids)].tolist() == block_ids
    lists["r1"].append(7)  # a decode crossed into a new block
    lists["r3"] = [42]  # preempted and readmitted: a new, shorter list
    rows = tables.rows_for([scheduled(k, v) for k, v in lists.items()])
    assert tables.table[rows[1], :3].tolist() == [1, 101, 7]
    assert tables.table[rows[3], :1].tolist() == [42]
    tables.release("r0")
    again = tables.rows_for([scheduled("new", [9, 8])])
    assert again[0] == rows[0] and tables.table[again[0], :2].tolist() == [9, 8]
    assert len(np.unique(rows)) == len(rows)
