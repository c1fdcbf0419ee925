"""schema/: strict typed decoding, and msgspec's refusals turned into our RequestError naming the field."""
import pytest

from daemon_protocol import RequestError
from schema import ChatCompletionRequest, CompletionRequest, ScoreRequest, decode
from schema.anthropic import MessagesRequest
from schema.embeddings import EmbeddingsBody, EmbeddingsRequest, TokenizeRequest

USER = {"messages": [{"role": "user", "content": "hi"}]}


def refusal(data, kind=ChatCompletionRequest) -> RequestError:
    with pytest.raises(RequestError) as raised:
        decode(data, kind)
    assert raised.value.status == 400
    return raised.value


@pytest.mark.parametrize("data, kind, message, param", [
    ({**USER, "n": "2"}, ChatCompletionRequest, "n must be an integer >= 1, got '2'", "n"),
    ({**USER, "top_k": True}, ChatCompletionRequest, "top_k must be an integer (0 or less: off), got True", "top_k"),
    ({**USER, "seed": 2**64}, ChatCompletionRequest, f"seed must be an integer in [0, 2**64), got {2**64}", "seed"),
    ({**USER, "logit_bias": {"5": "x"}}, ChatCompletionRequest,
     "logit_bias['5'] must be a number from -100 to 100, got 'x'", "logit_bias"),
    ({**USER, "stream_options": {"include_usage": True, "x": 1}}, ChatCompletionRequest,
     "stream_options.x is not supported here; leave it out (supported: include_usage)", "stream_options"),
    ({"messages": [{"content": [{"type": "text", "text": 1}]}]}, ChatCompletionRequest,
     "messages[0].content[0].text must be a string, got 1", "messages"),
    ({**USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, ChatCompletionRequest,
     "tools[0].function.name must be 1-64 letters, digits, '_' or '-', got 'a b'", "tools"),
    ({"prompt": 5}, CompletionRequest,
     "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids, got 5",
     "prompt"),
    ({"prompt": "x", "logprobs": 6}, CompletionRequest, "logprobs must be an integer from 0 to 5, got 6", "logprobs"),
    ({"text_1": "a", "text_2": []}, ScoreRequest, "text_2 must be a string or a non-empty list of strings, got []",
     "text_2"),
    ({"model": "m", "messages": [], "max_tokens": 0}, MessagesRequest, "max_tokens must be an integer >= 1, got 0",
     "max_tokens"),
    ({"model": "m", "messages": []}, MessagesRequest, "max_tokens is required", "max_tokens"),
    ({"input": ["a", ""]}, TokenizeRequest, "input[1] must be a non-empty string, got ''", "input"),
    ({"input": [[1, True]]}, EmbeddingsRequest, "input[0][1] must be an integer, got True", "input"),
    ({"input": "a", "encoding_format": "int8"}, EmbeddingsBody, "encoding_format must be 'float' or 'base64', got "
     "'int8'", "encoding_format"),
])
def test_a_refusal_names_the_field_what_it_must_be_and_what_came(data, kind, message, param):
    error = refusal(data, kind)
    assert (str(error), error.param) == (message, param)


def test_a_null_top_level_field_is_the_field_left_out():
    request = decode({**USER, "n": None, "stream": None, "temperature": None}, ChatCompletionRequest)
    assert (request.n, request.stream, request.temperature) == (1, False, None)


def test_request_data_that_is_not_a_map():
    error = refusal(["hi"])
    assert (str(error), error.param) == ("request data must be a map, got list", None)


def test_what_decodes_keeps_its_values_and_types():
    request = decode({**USER, "temperature": 1, "stop": "x", "tool_choice": {"type": "function",
                                                                            "function": {"name": "f"}}},
                     ChatCompletionRequest)
    assert request.temperature == 1.0 and isinstance(request.temperature, float)
    assert request.stop_strings() == ("x",) and request.tool_choice.function.name == "f"
    assert request.messages[0].speaker == "user" and decode({"messages": [{}]}, ChatCompletionRequest).messages[
        0].speaker == "user"


@pytest.mark.parametrize("kind, data", [(ChatCompletionRequest, USER), (CompletionRequest, {"prompt": "x"})])
def test_a_field_the_server_does_not_know_is_refused_not_ignored(kind, data):
    error = refusal({**data, "prediction": {"type": "content", "content": "x"}}, kind)
    assert error.param == "prediction"
    assert str(error).startswith("prediction is not supported here; leave it out (supported: ")
    assert "temperature" in str(error)
    decode({**data, "user": "u", "prompt_cache_key": "k", "safety_identifier": "s"}, kind)  # bookkeeping only
