"""Reading the Temporal peer's result line in ``bench saga --peer temporal``."""

from __future__ import annotations

import pytest

from saga_engine.bench import saga


def test_the_peer_rate_is_its_sagas_over_its_elapsed_time_not_its_rounded_print() -> None:
    out = "warming up\ntemporal: 500 sagas (50 compensated) in 21.03s = 23.8 sagas/s\n"
    peer = saga.peer_result(out)
    assert peer == saga.PeerResult(sagas=500, compensated=50, elapsed_s=21.03)
    # 23.776, not the printed 23.8: against 713.988 sagas/s that is 30.03 x, not 29.999 x.
    assert peer.per_s == pytest.approx(23.7756, abs=1e-4)


@pytest.mark.parametrize(
    "out",
    ["", "temporal: failed", "temporal: 500 sagas (50 compensated) in 0.00s = 0.0 sagas/s"],
)
def test_output_without_a_usable_result_line_gives_none(out: str) -> None:
    assert saga.peer_result(out) is None
