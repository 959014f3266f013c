"""JSON logs: one object per line, with the request's id and timings."""

from __future__ import annotations

import json
import logging

import pytest

from cluster.observability.logs import JsonFormatter, configure_logging


def test_json_lines_carry_the_request_fields() -> None:
    record = logging.LogRecord("cluster.serving.http.gateway", logging.INFO, __file__, 1, "%s: done", ("cmpl-1",), None)
    record.request_id, record.status, record.duration_s = "cmpl-1", 200, 0.25
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "cmpl-1: done" and line["level"] == "info"
    assert line["logger"] == "cluster.serving.http.gateway"
    assert (line["request_id"], line["status"], line["duration_s"]) == ("cmpl-1", 200, 0.25)
    assert line["time"].endswith("+00:00")


def test_configure_logging_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml")
