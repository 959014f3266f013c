"""Logging for the serving process: plain lines for a terminal, or one JSON object per line for a
log pipeline (`pdserve serve --log-format json`).

Fields every JSON line has: `time` (ISO 8601, UTC), `level`, `logger`, `message`. Lines about one
request add what they know through `extra=`: `request_id`, `worker_id`, `status`, `duration_s`,
`prompt_tokens`, `completion_tokens`, `finish_reason` (the gateway's request lines do).
"""

from __future__ import annotations

import datetime
import json
import logging

FIELDS = ("request_id", "worker_id", "method", "path", "status", "duration_s", "prompt_tokens", "completion_tokens",
          "finish_reason")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        created = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line = {"time": created.isoformat(timespec="milliseconds"),
                "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        line.update({name: getattr(record, name) for name in FIELDS if hasattr(record, name)})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """Send the root logger to stderr in `log_format` ("text" or "json") at `level`."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
