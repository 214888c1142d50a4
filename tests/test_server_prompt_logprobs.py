"""/v1/completions prompt_logprobs (vLLM extension): validation and the response shape."""
import pytest
from pydantic import ValidationError

from tests.test_server_units import LIMITS, FakeTokenizer
from tokenmill.sequence import TokenLogprobs
from tokenmill.server.errors import OpenAIError
from tokenmill.server.inputs import completion_inputs
from tokenmill.server.logprobs import TokenTexts, prompt_logprobs_json
from tokenmill.server.protocol import CompletionRequest


def test_prompt_logprobs_validation():
    (inp,) = completion_inputs(CompletionRequest(prompt="abc", prompt_logprobs=3), FakeTokenizer(), LIMITS)
    assert inp.params.prompt_logprobs == 3
    (inp,) = completion_inputs(CompletionRequest(prompt="abc"), FakeTokenizer(), LIMITS)
    assert inp.params.prompt_logprobs is None
    for bad in (-1, 21, 1.5, "2", True):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", "prompt_logprobs": bad})
    with pytest.raises(OpenAIError) as e:
        completion_inputs(CompletionRequest(prompt="abc", prompt_logprobs=0, stream=True), FakeTokenizer(), LIMITS)
    assert e.value.status == 400 and "stream" in e.value.message


class _Decode:
    def decode(self, ids, **kw):
        return f"<{ids[0]}>"


def test_prompt_logprobs_json_shape():
    plp = [None, TokenLogprobs(7, -2.5, 3, {4: -0.5, 9: -1.0}), TokenLogprobs(4, -0.25, 1, {4: -0.25}),
           TokenLogprobs(5, float("-inf"), 300, {})]
    out = prompt_logprobs_json(plp, TokenTexts(_Decode()))
    assert out[0] is None
    assert out[1] == {"7": {"logprob": -2.5, "rank": 3, "decoded_token": "<7>"},
                      "4": {"logprob": -0.5, "rank": 1, "decoded_token": "<4>"},
                      "9": {"logprob": -1.0, "rank": 2, "decoded_token": "<9>"}}
    assert list(out[1]) == ["7", "4", "9"]                      # the prompt token first, as vLLM
    assert out[2] == {"4": {"logprob": -0.25, "rank": 1, "decoded_token": "<4>"}}
    assert out[3]["5"]["logprob"] == -9999.0                    # JSON has no -inf
