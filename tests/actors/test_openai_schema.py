"""The OpenAPI document's server limits, without a server: where openai_protocol marks them, the
document carries this model's name, vocabulary and context, and media parts only with a vision tower."""

import json
import re

import pytest

from k3ray.actors.openai.protocol import LIMIT, ChatCompletionRequest, CompletionRequest
from k3ray.actors.openai.schema import ServerLimits, below_pattern, fill_in_limits

TEXT_ONLY = ServerLimits("k3-doc", vocab_size=512, max_model_len=96, supports_media=False, api_key=False)


@pytest.mark.parametrize("limit", [1, 2, 7, 10, 11, 100, 101, 512, 1000, 163840])
def test_below_pattern_matches_exactly_the_token_ids(limit):
    pattern = re.compile(f"^0*(?:{below_pattern(limit)})$")
    for number in [*range(min(limit + 50, 3000)), limit, limit + 1, 10 * limit]:
        assert bool(pattern.match(str(number))) == (number < limit), (limit, number)
    assert pattern.match(f"00{limit - 1}") and not pattern.match("-1") and not pattern.match("+1")


def test_the_limits_are_written_where_marked():
    completion = fill_in_limits(CompletionRequest.model_json_schema(), TEXT_ONLY)
    props = completion["properties"]
    assert {"type": "string", "enum": ["k3-doc"]} in props["model"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": 95} in props["max_tokens"]["anyOf"]
    token_ids = props["prompt"]["anyOf"][2]["items"]
    assert (token_ids["minimum"], token_ids["maximum"]) == (0, 511)
    (bias,) = (b for b in props["logit_bias"]["anyOf"] if b["type"] == "object")
    assert re.match(bias["propertyNames"]["pattern"], "511") and not re.match(bias["propertyNames"]["pattern"], "512")
    assert LIMIT not in json.dumps(completion)


@pytest.mark.parametrize("supports_media", [False, True])
def test_media_parts_only_with_a_vision_tower(supports_media):
    limits = ServerLimits("k3-doc", 512, 96, supports_media=supports_media, api_key=False)
    text = json.dumps(fill_in_limits(ChatCompletionRequest.model_json_schema(), limits))
    assert ('"image_url"' in text and '"video_url"' in text) == supports_media
    assert '"text"' in text and LIMIT not in text
