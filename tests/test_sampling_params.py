import pytest

from compilelm.sampling_params import SamplingParams, SamplingType

INVALID = [
    ("n", 0),
    ("n", 1.5),
    ("temperature", -1),
    ("temperature", float("nan")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("seed", 1.0),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("max_tokens", 0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", 2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("output_kind", 2),  # an int, not a RequestOutputKind
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_value_names_its_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=5)  # no cap: any min_tokens is fine


def test_message_shows_bound_and_value():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_p=1.0),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(presence_penalty=-2, frequency_penalty=2),
        dict(max_tokens=None),
        dict(temperature=0),
        dict(seed=0),
    ],
)
def test_edge_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_stop_normalized_to_lists():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == []
    assert SamplingParams().stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=3).is_greedy
    assert SamplingParams(temperature=1e-5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_clone_is_independent_and_validated():
    params = SamplingParams(stop=["x"], stop_token_ids=[7], temperature=0.5)
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("y")
    copy.stop_token_ids.append(8)
    assert params.stop == ["x"] and params.stop_token_ids == [7]
    params.top_p = 0.0  # mutable, but a clone re-validates
    with pytest.raises(ValueError, match="top_p"):
        params.clone()
