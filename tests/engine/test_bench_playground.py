"""`bench playground`'s same-window ratios: run i of a path against run i of the in-process one (the paths take
turns, so a pair shares the machine's window)."""
import pytest

from engine_service.bench.playground import MODES, same_window_ratios


def _run(tpot: dict[str, float | None]) -> dict:
    return {"modes": {m: {"tpot_ms": v} for m, v in tpot.items()}}


def test_ratios_pair_runs_by_round_not_by_rank():
    # a machine that slows down: the browser is 1.1x the in-process engine in every round, while its runs sorted
    # against the in-process ones sorted would say anything from 0.55x to 2.2x
    inproc = [_run(dict.fromkeys(MODES, t)) for t in (30.0, 60.0, 40.0)]
    browser = [_run(dict.fromkeys(MODES, t * 1.1)) for t in (30.0, 60.0, 40.0)]
    got = same_window_ratios({"browser": browser, "inprocess": inproc})
    assert list(got) == ["browser/inprocess"]
    assert got["browser/inprocess"] == pytest.approx(dict.fromkeys(MODES, 1.1))


def test_a_mode_without_a_tpot_is_left_out_and_no_base_gives_nothing():
    # the API streams beams once final: no TPOT there, so no ratio for beam
    api = [_run({"greedy": 44.0, "beam": None, "sample": 45.0, "speculative": 43.0})] * 2
    inproc = [_run({"greedy": 40.0, "beam": 40.0, "sample": 40.0, "speculative": 40.0})] * 2
    got = same_window_ratios({"api": api, "inprocess": inproc})["api/inprocess"]
    assert "beam" not in got and got["greedy"] == pytest.approx(1.1)
    assert same_window_ratios({"api": api}) == {}
