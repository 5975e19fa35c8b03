"""The services the example sagas call: each owns its tables, its messages and its handlers.

Table names carry the service's name only because the demo runs every service in one database;
in production each service has its own database, and ``WorkerOptions(participant_dbs=...)`` says
where.
"""

from __future__ import annotations

from typing import Any, cast

import sqlalchemy as sa


def rowcount(result: sa.Result[Any]) -> int:
    """Rows an UPDATE matched. ``Session.execute`` is typed as returning a plain ``Result``;
    for DML it is a ``CursorResult``, which has the count."""
    return cast("sa.CursorResult[Any]", result).rowcount
