"""The columns' requests from whatever the controls hold (web/modes.py): None for a number (Gradio passes None for
an empty value, as its API clients may send), a fraction where a whole number goes, NaN or infinity. Pure request
building, no server.

Found by a property run of the controls (session 37): None for temperature, top-p, min-p or the length penalty
raised TypeError out of the run's preparation (float(None)), so the whole run failed instead of its column showing
what to fix (whole numbers already went through `_int`).
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_service.engine.sampling_params import SamplingParams
from web.modes import CONSTRAINTS, MODES, InputError, Settings, build_request


def test_an_emptied_number_box_is_its_off_value_or_says_what_to_enter():
    s = Settings(prompt="x", top_p=None, min_p=None)
    params = build_request("sample", s).params
    assert (params.top_p, params.min_p) == (1.0, 0.0)  # empty means off, as for top-k
    with pytest.raises(InputError, match="^temperature: enter a number"):
        build_request("sample", Settings(prompt="x", temperature=None))
    with pytest.raises(InputError, match="^length penalty: enter a number"):
        build_request("beam", Settings(prompt="x", length_penalty=None))
    with pytest.raises(InputError, match="^temperature: must be a finite number"):
        build_request("sample", Settings(prompt="x", temperature=float("nan")))


number = (st.none() | st.integers(-3, 2000) | st.floats(allow_nan=True, allow_infinity=True)
          | st.sampled_from([0, 1, 0.5, -1, 4.0, 1e9]))
constraints = st.sampled_from([("none", ""), *[(kind, text) for kind in CONSTRAINTS[1:] for text in
                                               ("", "yes\nno", "[a-z]+", '{"type": "integer"}', "[1]", "{")]])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(list(MODES)), constraint=constraints, chat=st.booleans(),
       numbers=st.fixed_dictionaries({name: number for name in (
           "max_tokens", "beam_width", "length_penalty", "beams_shown", "temperature", "top_k", "top_p", "min_p",
           "seed", "n", "spec_k")}))
def test_any_controls_give_an_input_error_or_a_request_the_engine_takes(mode, constraint, chat, numbers):
    kind, text = constraint
    s = Settings(prompt="x", chat=chat, constraint_type=kind, constraint=text, **numbers)
    try:
        request = build_request(mode, s)
    except InputError:
        return
    SamplingParams(**request.params.model_dump())  # the engine's own rules (a ValueError here would reach the column)
