"""Logging: plain text, or one JSON object per line (request id and trace id on the access line; never prompt
text). The access log (`kvgate.access`) has one line per client request."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime

import orjson

from gateway.config import LoggingConfig


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            line.update(access)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class _TextAccess(logging.Formatter):
    """Text lines: the access fields as key=value after the message."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            text += " " + " ".join(f"{key}={_text_value(value)}" for key, value in access.items())
        return text


def _text_value(value: object) -> str:
    """As is, or JSON-quoted when it could blur the line (an error message), so it still splits into key=value."""
    text = str(value)
    return orjson.dumps(text).decode() if any(c in text for c in ' "=\n\r') else text


class _KvgateHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """kvgate's own root handler: replaced when logging is configured again, other handlers left alone."""


def configure_logging(level: str, settings: LoggingConfig | None = None) -> logging.Handler:
    """The root handler (stderr) in the configured format; the access log on or off."""
    settings = settings or LoggingConfig()
    handler = _KvgateHandler(sys.stderr)
    handler.setFormatter(JsonLines() if settings.format == "json" else
                         _TextAccess("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for existing in [h for h in root.handlers if isinstance(h, _KvgateHandler)]:
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("kvgate.access").disabled = not settings.access_log
    return handler
