"""A worker's measured costs: the JSON profile the simulator and the planner read.

Three tables, each of wall seconds on one worker of the machine recorded in `machine`:
- prefill: one step that computes `tokens` prompt tokens of a request whose first `context` tokens
  are computed already (a chunk of a chunked prefill, or a whole prompt at context 0);
- decode: one step of `batch` running requests each at `context` tokens (one new token each);
- transfer: moving `bytes` of KV out of one worker's cache and into another's.
And what serving adds around the steps (`Serving`, per mode): the fixed latency of a request's first
token (the client's call through Ray to the router, the decode worker's reservation round trip in
disaggregated mode, the worker's queue, the first token's event back), what a served worker adds
to each step (its event loop dispatching the step's tokens), how much longer a served worker's
engine step takes than the engine alone's (`step_factor`), and the front door's CPU on the cores
the workers share (`front_door.py`). `pdserve profile` times one engine and
leaves them zero; `cluster.bench.planner_runs.measure_serving` times them on a cluster it started.

Between measured points the tables are interpolated linearly (bilinearly for the two-axis ones),
and past the last point extrapolated along the last segment: step time grows about linearly in
tokens on a CPU, so a straight line is the honest guess beyond the grid. Standard library only:
the simulator, and everything that plans from a profile, runs without torch.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 3
# version 1: no `serving`, read as zeros; version 2: `serving` without the step factor and the front
# door's costs, read as a factor of 1 and a front door that costs nothing
READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True, slots=True)
class Grid:
    """Seconds on a (row, column) grid: rows[i] x columns[j] -> seconds[i][j]."""

    rows: list[int]
    columns: list[int]
    seconds: list[list[float]]

    def __post_init__(self) -> None:
        if not self.rows or not self.columns:
            raise ValueError("a profile grid needs at least one row and one column")
        if self.rows != sorted(set(self.rows)) or self.columns != sorted(set(self.columns)):
            raise ValueError(f"grid axes must be increasing without repeats, got {self.rows} and {self.columns}")
        if len(self.seconds) != len(self.rows) or any(len(row) != len(self.columns) for row in self.seconds):
            raise ValueError(f"grid seconds must be {len(self.rows)} rows of {len(self.columns)} values")

    def monotone(self) -> Grid:
        """The same grid, made non-decreasing along both axes (a running maximum): a step with more
        tokens, rows or context never takes less time, so a smaller time measured there is noise
        (another process took the core), and a noisy dip would extrapolate to steps of no cost."""
        seconds = [list(itertools.accumulate(row, max)) for row in self.seconds]
        for j in range(len(self.columns)):
            for i in range(1, len(self.rows)):
                seconds[i][j] = max(seconds[i][j], seconds[i - 1][j])
        return Grid(self.rows, self.columns, seconds)

    def at(self, row: float, column: float) -> float:
        across = [interpolate(self.columns, values, column) for values in self.seconds]
        return max(interpolate(self.rows, across, row), 0.0)


def interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys); linear beyond the ends along the nearest segment."""
    if len(xs) == 1:
        return ys[0]
    index = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[index], xs[index + 1], ys[index], ys[index + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class Serving:
    """What serving adds to the engine's steps on one kind of cluster, in seconds."""

    first_token_s: float = 0.0  # the request's hops to its worker and its first token's back
    step_s: float = 0.0  # added to every step of a served worker (the event loop's dispatch)
    step_factor: float = 1.0  # a served worker's engine step over the engine alone's (the profile's)
    # The front door's CPU on the cores the workers share (`front_door.py`): idle, in cores; per
    # request and per streamed token, in CPU seconds.
    front_door_idle_cores: float = 0.0
    front_door_request_cpu_s: float = 0.0
    front_door_token_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.first_token_s, self.step_s, self.front_door_idle_cores, self.front_door_request_cpu_s,
               self.front_door_token_cpu_s) < 0 or self.step_factor <= 0:
            raise ValueError(f"serving latencies and costs must be >= 0 and the step factor > 0, got {self}")


@dataclass(frozen=True, slots=True)
class Profile:
    """What `pdserve profile` measured; `step_seconds` is the one question the simulator asks."""

    prefill: Grid  # rows: tokens computed in the step; columns: context before them
    decode: Grid  # rows: batch size; columns: context length of each request
    transfer_bytes: list[int]
    transfer_seconds: list[float]
    kv_bytes_per_token: int
    block_size: int = 16
    kv_capacity_tokens: int = 0  # KV tokens one worker holds (0: unlimited, not modelled)
    model: str = ""
    dtype: str = ""
    threads: int = 0
    machine: dict[str, Any] = field(default_factory=dict)
    serving: dict[str, Serving] = field(default_factory=dict)  # by mode: "colocated", "disaggregated"
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if len(self.transfer_bytes) != len(self.transfer_seconds) or not self.transfer_bytes:
            raise ValueError("transfer_bytes and transfer_seconds must be non-empty and of one length")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")

    def serving_for(self, mode: str) -> Serving:
        return self.serving.get(mode, Serving())

    @property
    def cores(self) -> int:
        """The profiled machine's cores (0: not recorded)."""
        return int(self.machine.get("cores") or 0)

    def prefill_seconds(self, tokens: int, context: int) -> float:
        return self.prefill.at(tokens, context)

    def decode_seconds(self, batch: int, context: float) -> float:
        return self.decode.at(batch, context) if batch else 0.0

    def transfer_seconds_for(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return max(interpolate(self.transfer_bytes, self.transfer_seconds, num_tokens * self.kv_bytes_per_token), 0.0)

    def step_seconds(self, chunks: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """One engine step: prompt `chunks` (tokens, context) and one token for each decode row.

        A mixed step costs its decode part plus each chunk's prefill time, less the fixed per-step
        cost counted once too many (the intercept of the prefill table at context 0, which both
        parts include): on a CPU every row goes through the same linear layers, so costs add.
        """
        decode = self.decode_seconds(len(decode_contexts), sum(decode_contexts) / len(decode_contexts)) \
            if decode_contexts else 0.0
        prefill = sum(self.prefill_seconds(tokens, context) for tokens, context in chunks)
        parts = len(chunks) + (1 if decode_contexts else 0)
        return max(decode + prefill - (parts - 1) * self.step_overhead_seconds, 1e-6)

    def prefill_knee(self, share: float = 0.9) -> int:
        """The knee of the token-budget sweep: the fewest tokens per step (at context 0) whose prefill
        throughput reaches `share` of the best measured. A larger `max_num_batched_tokens` buys
        little throughput there, and every token more lengthens the steps decode rows share."""
        rates = [tokens / values[0] for tokens, values in zip(self.prefill.rows, self.prefill.seconds, strict=True)]
        return next(tokens for tokens, rate in zip(self.prefill.rows, rates, strict=True) if rate >= share * max(rates))

    @property
    def step_overhead_seconds(self) -> float:
        """The fixed cost of a step (the prefill line through its first two points, at 0 tokens)."""
        rows = self.prefill.rows
        first = [values[0] for values in self.prefill.seconds]
        if len(rows) < 2:
            return 0.0
        return min(max(interpolate(rows, first, 0), 0.0), first[0])

    def beyond(self, longest_prompt: int, longest_context: int) -> list[str]:
        """What a workload asks outside the measured grid: extrapolated, so less to be trusted."""
        notes = []
        if longest_prompt > self.prefill.rows[-1] + self.prefill.columns[-1]:
            notes.append(f"prompts of up to {longest_prompt} tokens, prefill measured to "
                         f"{self.prefill.rows[-1]} tokens at context {self.prefill.columns[-1]}")
        if longest_context > self.decode.columns[-1]:
            notes.append(f"contexts of up to {longest_context} tokens, decode measured to {self.decode.columns[-1]}")
        return notes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.as_dict(), indent=1) + "\n", encoding="utf-8")
        return path


def profile_from_dict(values: dict[str, Any]) -> Profile:
    if values.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"profile version must be one of {READABLE_VERSIONS}, got {values.get('version')!r}: "
                         "measure it again with `pdserve profile`")
    values = {**values, "version": PROFILE_VERSION}
    try:
        values["prefill"] = Grid(**values["prefill"])
        values["decode"] = Grid(**values["decode"])
        values["serving"] = {mode: Serving(**figures) for mode, figures in values.get("serving", {}).items()}
        return Profile(**values)
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not a pdserve profile: {error}") from None


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in the file at `path`; a clear ValueError naming `what` it should be otherwise."""
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the {what} {path}: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a {what} is a JSON object")
    return values


def load_profile(path: str | Path) -> Profile:
    return profile_from_dict(read_json_object(path, "profile"))
