"""Where a transfer's time goes: timestamps of its steps on both sides, kept only when switched on.

`benchmarks/kv_transfer.py` switches it on in its two processes and lines the marks up (both use
CLOCK_MONOTONIC, which processes on one host share) to report per step: the sender's mapping, posting
the header, copy, marker, wait for the ack; the receiver's wake-up for the header and for the marker,
and its ack. Off (the default) a mark is one attribute test.
"""

from __future__ import annotations

import time

# The steps, in the order one in-place frame passes them ("S" sender, "R" receiver).
SENDER_STEPS = ("send", "mapped", "header_out", "copied", "marker_out", "acked")
RECEIVER_STEPS = ("header_in", "admitted", "marker_in", "landed", "ack_out")


class PhaseLog:
    """(request id, step, CLOCK_MONOTONIC seconds) of each step marked while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.marks: list[tuple[str, str, float]] = []

    def mark(self, request_id: str, step: str) -> None:
        if self.on:
            self.marks.append((request_id, step, time.monotonic()))


def breakdown(sender: list[tuple[str, str, float]], receiver: list[tuple[str, str, float]],
              request_id: str) -> dict[str, float]:
    """Milliseconds per step of one single-frame transfer, from both sides' marks: what each side
    did, and how long each message took to wake the other side (`*_wake`). Steps missing: left out."""
    at = {f"S {step}": moment for rid, step, moment in sender if rid == request_id}
    at |= {f"R {step}": moment for rid, step, moment in receiver if rid == request_id}
    spans = {"map": ("S send", "S mapped"), "post_header": ("S mapped", "S header_out"),
             "copy": ("S header_out", "S copied"), "post_marker": ("S copied", "S marker_out"),
             "header_wake": ("S header_out", "R header_in"), "admit": ("R header_in", "R admitted"),
             "marker_wake": ("S marker_out", "R marker_in"), "land_and_ack": ("R marker_in", "R ack_out"),
             "ack_wake": ("R ack_out", "S acked"), "after_copy": ("S copied", "S acked"),
             "total": ("S send", "S acked")}
    return {name: 1e3 * (at[end] - at[start]) for name, (start, end) in spans.items() if start in at and end in at}
