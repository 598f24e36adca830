"""The one wall clock of records: the current time in UTC, ISO 8601."""

from __future__ import annotations

import datetime


def utc_now() -> str:
    """The current time in UTC, ISO 8601 with microseconds (records, run metadata).

    Examples:
        >>> from graphmod._core._clock import utc_now
        >>> utc_now().endswith("+00:00")
        True
    """
    return datetime.datetime.now(datetime.UTC).isoformat()
