"""Which roles each worker of ``bench saga`` runs under ``--layout``."""

from __future__ import annotations

import pytest

from saga_engine import errors, worker
from saga_engine.bench import saga
from saga_engine.cli import build_parser


def test_services_give_the_first_worker_the_orchestration_and_the_rest_the_participants() -> None:
    assert saga.worker_roles("services", 3) == [
        "orchestrator,relay,deadlines,cleanup",
        "participants",
        "participants",
    ]


def test_between_services_and_participants_every_role_runs_somewhere() -> None:
    roles = [role for own in saga.worker_roles("services", 2) for role in (own or "").split(",")]
    assert sorted(roles) == sorted(worker.ROLES)  # each once


@pytest.mark.parametrize(("layout", "count"), [("services", 1), ("replicas", 1), ("replicas", 3)])
def test_one_worker_or_replicas_run_every_role(layout: str, count: int) -> None:
    assert saga.worker_roles(layout, count) == [None] * count


def test_an_unknown_layout_is_refused() -> None:
    with pytest.raises(errors.ConfigurationError, match="--layout must be one of"):
        saga.Options(db="postgresql://", layout="mixed")


@pytest.mark.parametrize("layout", saga.LAYOUTS)
def test_the_bench_command_offers_every_layout(layout: str) -> None:
    # The parser spells the choices out (importing the bench would slow every command's start).
    assert build_parser().parse_args(["bench", "saga", "--layout", layout]).layout == layout
