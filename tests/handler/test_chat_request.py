"""OpenAI chat request -> prompt tokens and sampling parameters, and every way a request can be wrong."""

import copy
import dataclasses
import json
import math

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers
from transformers import PreTrainedTokenizerFast

from handler.chat import ChatModel, RequestError, max_chars_per_token, parse_chat_request, sampling_defaults
from handler.limits import RequestLimits
from handler.tokenizer import embedding_token_ids

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model(smollm2_tokenizer):
    return ChatModel(smollm2_tokenizer, MAX_MODEL_LEN, (smollm2_tokenizer.eos_token_id,), {})


def user(text):
    return {"messages": [{"role": "user", "content": text}]}


def expected_prompt(tokenizer, messages, **kwargs):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_prompt_is_the_chat_template_with_a_generation_prompt(model):
    request = parse_chat_request(user("What is the capital of France?"), model)
    text = model.tokenizer.decode(request.prompt_token_ids)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_ids_are_the_tokenizers_own_for_special_tokens_and_any_script(model):
    messages = [{"role": "system", "content": "Réponds en une phrase. 日本語も。"},
                {"role": "user", "content": "Emoji 🦀, tabs\tand <|im_start|> typed by the user"}]
    request = parse_chat_request({"messages": messages}, model)
    assert request.prompt_token_ids == expected_prompt(model.tokenizer, messages)


def test_truncation_left_by_an_embedding_input_never_cuts_a_prompt(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)  # an encoding thread's copy serves tokenize and chat alike
    assert len(embedding_token_ids(tokenizer, ["one two three four five six seven"], keep_last=3)[0]) == 3
    request = parse_chat_request(user("one two three four five six seven"), ChatModel(tokenizer, MAX_MODEL_LEN, (), {}))
    assert request.prompt_token_ids == expected_prompt(smollm2_tokenizer, user("one two three four five six seven")[
        "messages"])


def test_content_parts_nil_content_and_missing_role(model):
    parts = parse_chat_request({"messages": [{"content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]},
                                             {"role": "assistant", "content": None}]}, model)
    assert parts.prompt_token_ids == expected_prompt(
        model.tokenizer, [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}])


def test_add_generation_prompt_false(model):
    request = parse_chat_request({**user("hi"), "add_generation_prompt": False}, model)
    assert model.tokenizer.decode(request.prompt_token_ids).endswith("<|im_start|>user\nhi<|im_end|>\n")


def test_chat_template_kwargs_reach_the_template(model):
    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.chat_template = "{{ 'deep ' if enable_thinking else 'quick ' }}{{ messages[0]['content'] }}"
    thinking = ChatModel(tokenizer, MAX_MODEL_LEN, (), {})
    for flag, word in ((True, "deep"), (False, "quick")):
        request = parse_chat_request({**user("hi"), "chat_template_kwargs": {"enable_thinking": flag}}, thinking)
        assert tokenizer.decode(request.prompt_token_ids) == f"{word} hi"


def test_defaults_like_vllm(model):
    request = parse_chat_request(user("hi"), model)
    params = request.params
    assert params.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)
    assert params.stop_token_ids == (model.tokenizer.eos_token_id,)
    assert request.stop == ()


def test_sampling_fields_pass_through(model):
    request = parse_chat_request({**user("hi"), "temperature": 0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "seed": 3,
                                  "presence_penalty": 1, "frequency_penalty": -1, "repetition_penalty": 1.2,
                                  "max_completion_tokens": 9, "max_tokens": 20, "stop": "x", "n": 1}, model)
    params = request.params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0, 0.5, 7, 0.1, 3)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (1, -1, 1.2)
    assert params.max_tokens == 9, "max_completion_tokens wins over the deprecated max_tokens"
    assert request.stop == ("x",)


def test_ignore_eos_drops_the_stop_tokens(model):
    params = parse_chat_request({**user("hi"), "ignore_eos": True}, model).params
    assert params.ignore_eos and params.stop_token_ids == ()


def test_generation_config_supplies_defaults(tmp_path, smollm2_tokenizer):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 10, "do_sample": True}))
    defaults = sampling_defaults(str(tmp_path))
    model = ChatModel(smollm2_tokenizer, MAX_MODEL_LEN, (), defaults)
    params = parse_chat_request(user("hi"), model).params
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 0.95, 10)
    params = parse_chat_request({**user("hi"), "temperature": 0, "max_tokens": 3}, model).params
    assert (params.temperature, params.max_tokens) == (0, 3)


def test_developer_messages_are_system_messages_and_the_plain_roles_are_taken(model):
    """The tool role, which needs an assistant's tool call to answer, is tested with tools
    (test_output_plan.py, test_chat_features.py)."""
    developer = parse_chat_request({"messages": [{"role": "developer", "content": "Be brief."},
                                                 {"role": "user", "content": "hi"}]}, model)
    assert developer.prompt_token_ids == expected_prompt(
        model.tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    messages = [{"role": role, "content": role} for role in ("system", "user", "assistant", "user")]
    request = parse_chat_request({"messages": messages}, model)
    assert request.prompt_token_ids == expected_prompt(model.tokenizer, messages)


@pytest.mark.parametrize("data, param, message", [
    ({**user("hi"), "temperature": "hot"}, "temperature", "temperature must be a number >= 0, got 'hot'"),
    ({**user("hi"), "temperature": float("nan")}, "temperature", "temperature must be a number >= 0, got nan"),
    ({**user("hi"), "top_p": float("inf")}, "top_p", "top_p must be a number in (0, 1], got inf"),
    ({**user("hi"), "top_p": 1.5}, "top_p", "top_p must be a number in (0, 1], got 1.5"),
    ({**user("hi"), "min_p": [0.1]}, "min_p", "min_p must be a number in [0, 1], got [0.1]"),
    ({**user("hi"), "frequency_penalty": True}, "frequency_penalty",
     "frequency_penalty must be a number in [-2, 2], got True"),
    ({**user("hi"), "top_k": 2.5}, "top_k", "top_k must be an integer (0 or less: off), got 2.5"),
    ({**user("hi"), "seed": "1"}, "seed", "seed must be an integer in [0, 2**64), got '1'"),
    ({**user("hi"), "seed": -1}, "seed", "seed must be an integer in [0, 2**64), got -1"),
    ({**user("hi"), "max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({**user("hi"), "max_completion_tokens": "10"}, "max_completion_tokens",
     "max_completion_tokens must be an integer >= 1, got '10'"),
    ({**user("hi"), "n": 1.0}, "n", "n must be an integer >= 1, got 1.0"),
    ({**user("hi"), "stream": "yes"}, "stream", "stream must be a boolean, got 'yes'"),
    ({**user("hi"), "add_generation_prompt": 1}, "add_generation_prompt", "must be a boolean, got 1"),
    ({**user("hi"), "model": 3}, "model", "model must be a string, got 3"),
    ({**user("hi"), "user": {"id": 1}}, "user", "user must be a string"),
    ({**user("hi"), "stream_options": True}, "stream_options", "stream_options must be a map, got True"),
    ({**user("hi"), "metadata": []}, "metadata", "metadata must be a map"),
    ({**user("hi"), "stop": 5}, "stop", "stop must be a non-empty string or a list of non-empty strings, got 5"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages",
     "messages[0].role must be one of system, user, assistant, tool, developer, got 'wizard'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "alien", "content": "b"}]}, "messages",
     "messages[1].role must be one of"),
    ({"messages": [{"role": "user", "content": "a", "name": 7}]}, "messages", "messages[0].name must be a string"),
    ({"messages": [{"role": [], "content": "hi"}]}, "messages",
     "messages[0].role must be one of system, user, assistant, tool, developer, got []"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages", "messages[0].role must be one of"),
    (user("word " * 200), "messages", "maximum context length of 128"),
])
def test_bad_values_name_the_field_and_the_type_expected(model, data, param, message):
    with pytest.raises(RequestError) as raised:
        parse_chat_request(data, model)
    assert message in str(raised.value)
    assert (raised.value.status, raised.value.param) == (400, param)


def test_a_prompt_past_the_context_is_openais_context_length_exceeded(model):
    for data in (user("word " * 200), {**user("hi"), "max_tokens": 1000}):
        with pytest.raises(RequestError) as raised:
            parse_chat_request(data, model)
        assert raised.value.code == "context_length_exceeded"


@pytest.mark.parametrize("data, field", [
    ("hi", "request data must be a map"),
    ({}, "messages is required"),
    ({"messages": "hi"}, "messages must be a non-empty list of messages, got 'hi'"),
    ({"messages": []}, r"messages must be a non-empty list of messages, got \[\]"),
    ({"messages": [1]}, r"messages\[0\] must be a map"),
    ({"messages": [{"role": 3, "content": "x"}]},
     r"messages\[0\].role must be one of system, user, assistant, tool, developer, got 3"),
    ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\].content must be a string or a list"),
    ({"messages": [{"content": [{"type": "image_url", "image_url": {}}]}]},
     r"messages\[0\].content\[0\]: this model does not read images"),
    ({"messages": [{"content": [{"type": "text", "text": 1}]}]}, r"content\[0\].text must be a string"),
    ({**user("hi"), "temperature": -1}, "temperature must be a number >= 0, got -1"),
    ({**user("hi"), "temperature": "hot"}, "temperature"),
    ({**user("hi"), "top_p": 0}, "top_p"),
    ({**user("hi"), "top_k": 1.5}, "top_k"),
    ({**user("hi"), "presence_penalty": 3}, "presence_penalty"),
    ({**user("hi"), "seed": -1}, "seed"),
    ({**user("hi"), "ignore_eos": "yes"}, "ignore_eos"),
    ({**user("hi"), "max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({**user("hi"), "max_tokens": True}, "max_tokens must be an integer"),
    ({**user("hi"), "max_completion_tokens": 1000},
     "max_completion_tokens: this model's maximum context length is 128"),
    ({**user("hi"), "n": 17}, "n must be between 1 and 16"),
    ({**user("hi"), "stop": ["a", 1]}, r"stop\[1\] must be a non-empty string, got 1"),
    ({**user("hi"), "stop": [""]}, r"stop\[0\] must be a non-empty string, got ''"),
    ({**user("hi"), "stop": ["x"] * 17}, "at most 16 stop strings"),
    ({**user("hi"), "chat_template_kwargs": "x"}, "chat_template_kwargs must be a map"),
    ({**user("hi"), "chat_template_kwargs": {"tokenize": True}}, "the chat template rejected them"),
    (user("word " * 200), "messages: the prompt is .* tokens.* maximum context length of 128"),
    ({**user("hi"), "stop": ["x" * 1025]}, "stop: a stop string is at most 1024 characters"),
    ({**user("hi"), "user": "u", "metadata": {"deep": json.loads("[" * 200 + "]" * 200)}},
     "metadata nests lists and maps more than 100 levels deep"),
])
def test_bad_requests_name_the_problem(model, data, field):
    """Every refusal of a request map is a 400 whose `param` is the field its message starts with."""
    with pytest.raises(RequestError, match=field) as raised:
        parse_chat_request(data, model)
    assert raised.value.status == 400
    if isinstance(data, dict):
        assert raised.value.param and str(raised.value).startswith(raised.value.param), str(raised.value)


def test_a_trusted_templates_output_is_bounded(model):
    """A trusted template can write any amount ('a' * 3*10**8): past HFENDPOINT_MAX_PROMPT_CHARS it is refused."""
    trusting = dataclasses.replace(model, trust_request_chat_template=True, max_chars_per_token=None,
                                   limits=RequestLimits(max_prompt_chars=1000))
    with pytest.raises(RequestError, match="the chat template wrote a prompt of 5000 characters") as raised:
        parse_chat_request({**user("hi"), "chat_template": "{{ 'a' * 5000 }}"}, trusting)
    assert raised.value.param == "messages"


LOOPING_TEMPLATE = "{% for i in range(10**6) %}{% for j in range(10**6) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("data, field", [
    ({"chat_template_kwargs": {"chat_template": LOOPING_TEMPLATE}}, "chat_template_kwargs.chat_template"),
    ({"chat_template": LOOPING_TEMPLATE}, "chat_template"),
])
def test_templates_from_requests_are_refused_unless_trusted(model, data, field):
    """A template is a program: refused before anything renders (this one would loop for days)."""
    with pytest.raises(RequestError, match=f"^{field}: this server does not run chat templates sent with requests; "
                                           "its operator can allow them with HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE"):
        parse_chat_request({**user("hi"), **data}, model)


def test_trusted_templates_from_requests_are_used(model):
    trusting = dataclasses.replace(model, trust_request_chat_template=True)
    template = "[{{ messages[0]['content'] }}]"
    for data in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
        request = parse_chat_request({**user("hi"), **data}, trusting)
        assert trusting.tokenizer.decode(request.prompt_token_ids) == "[hi]"
    with pytest.raises(RequestError, match="^chat_template must be a string, got 3"):
        parse_chat_request({**user("hi"), "chat_template": 3}, trusting)


class CountingTokenizer:
    """The tokenizer, counting the texts its Rust backend tokenizes (in any of its encode methods)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    @property
    def backend_tokenizer(self):
        return CountingBackend(self)


class CountingBackend:
    def __init__(self, counting: CountingTokenizer):
        self.counting, self.backend = counting, counting.tokenizer.backend_tokenizer

    def __getattr__(self, name):
        method = getattr(self.backend, name)
        if not name.startswith("encode"):
            return method

        def counted(*args, **kwargs):
            self.counting.calls += 1
            return method(*args, **kwargs)
        return counted


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(model):
    bound = max_chars_per_token(model.tokenizer)
    counting = CountingTokenizer(model.tokenizer)
    bounded = dataclasses.replace(model, tokenizer=counting, max_chars_per_token=bound)
    with pytest.raises(RequestError, match=r"the prompt is 2100\d{4} characters, at least \d+ tokens.* 128 tokens"):
        parse_chat_request(user("x" * 21_000_000), bounded)
    assert counting.calls == 0
    with pytest.raises(RequestError, match=r"the prompt is \d+ tokens.* 128 tokens"):  # within the bound: counted
        parse_chat_request(user("x" * (bound * 100)), bounded)
    assert counting.calls == 1
    hi = user("hi")
    assert parse_chat_request(hi, bounded).prompt_token_ids == expected_prompt(model.tokenizer, hi["messages"])


def test_a_prompt_fits_when_it_leaves_room_for_one_token(model):
    """The context of max_model_len tokens holds the prompt and at least one generated token: a prompt of
    max_model_len - 1 tokens generates one, one of max_model_len or one more is refused."""
    num_tokens = len(parse_chat_request(user("hi"), model).prompt_token_ids)
    room_for_one = dataclasses.replace(model, max_model_len=num_tokens + 1)
    assert parse_chat_request(user("hi"), room_for_one).params.max_tokens == 1
    assert parse_chat_request({**user("hi"), "max_tokens": 1}, room_for_one).params.max_tokens == 1
    with pytest.raises(RequestError, match="prompt tokens plus 2 completion tokens") as raised:
        parse_chat_request({**user("hi"), "max_tokens": 2}, room_for_one)
    assert (raised.value.param, raised.value.code) == ("max_tokens", "context_length_exceeded")
    for max_model_len in (num_tokens, num_tokens - 1):
        with pytest.raises(RequestError, match=f"the prompt is {num_tokens} tokens") as raised:
            parse_chat_request(user("hi"), dataclasses.replace(model, max_model_len=max_model_len))
        assert (raised.value.param, raised.value.code) == ("messages", "context_length_exceeded")


def test_the_character_bound_refuses_a_prompt_that_leaves_no_room(model):
    """With a bound of one character per token a prompt of C characters has at least C tokens: refused before
    tokenizing where max_model_len is C or less, tokenized (and here served) where it is C + 1."""
    num_chars = len(model.tokenizer.apply_chat_template(user("hi")["messages"], tokenize=False,
                                                        add_generation_prompt=True))
    for max_model_len in (num_chars, num_chars - 1):
        bounded = dataclasses.replace(model, max_model_len=max_model_len, max_chars_per_token=1)
        with pytest.raises(RequestError, match=f"the prompt is {num_chars} characters, at least {num_chars} tokens"):
            parse_chat_request(user("hi"), bounded)
    room = dataclasses.replace(model, max_model_len=num_chars + 1, max_chars_per_token=1)
    assert parse_chat_request(user("hi"), room).prompt_token_ids == expected_prompt(model.tokenizer, user("hi")[
        "messages"])

def test_the_character_bound_holds_for_the_worst_texts(smollm2_tokenizer):
    """SmolLM2 (byte-level BPE, no normalizer): its longest vocabulary entry, and no text has fewer tokens than
    its characters divided by it, even one made of that longest token."""
    bound = max_chars_per_token(smollm2_tokenizer)
    vocab = smollm2_tokenizer.get_vocab()
    longest = max(vocab, key=len)
    assert bound == len(longest)
    texts = [smollm2_tokenizer.convert_tokens_to_string([longest]) * 50, "#" * 5000, "日本語のテキスト" * 300,
             "🙂" * 400, "<|im_start|>" * 200, " " * 4000, "the " * 1000]
    for text in texts:
        assert len(smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]) >= math.ceil(len(text) / bound)


def tokenizer_from(normalizer=None, byte_fallback=True, strip_special=False):
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4, **{f"<0x{i:02X}>": 5 + i for i in range(256)}}
    backend = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], unk_token="<unk>", byte_fallback=byte_fallback,
                                   fuse_unk=not byte_fallback))
    backend.normalizer = normalizer
    backend.add_special_tokens([AddedToken("<|special_end|>", rstrip=strip_special)])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("normalizer, byte_fallback, strip_special, bound", [
    (None, True, False, 15),                                         # "<|special_end|>"
    (normalizers.NFC(), True, False, 60),                            # composition merges up to 4 characters
    (normalizers.Sequence([normalizers.Replace("ab", "c"), normalizers.Lowercase()]), True, False, 30),
    (normalizers.Strip(), True, False, None),                         # may drop any amount of text
    (normalizers.Replace(Regex(r"\s+"), " "), True, False, None),
    (None, False, False, None),                                      # unknowns fused: one token for any run
    (None, True, True, None),                                        # rstrip swallows the spaces after it
])
def test_no_bound_where_a_token_may_stand_for_any_amount_of_text(normalizer, byte_fallback, strip_special, bound):
    assert max_chars_per_token(tokenizer_from(normalizer, byte_fallback, strip_special)) == bound
