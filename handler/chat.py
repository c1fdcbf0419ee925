"""An OpenAI chat completion request -> prompt token ids, sampling parameters and stop strings.

Every problem raises RequestError with a message naming the field; the protocol layer sends the
message back as the request's error reply. Defaults follow vLLM's OpenAI server: sampling fields the
request leaves out come from the model's generation_config.json, then from SamplingParams; max_tokens
defaults to the rest of the context.
"""

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine import SamplingParams
from models.model_files import read_generation_config

MAX_STOP_STRINGS = 16  # each is checked against the held-back text after every token
TEXT_PART_TYPES = ("text", "input_text", "output_text")
# generation_config.json key -> request field it supplies the default for
GENERATION_CONFIG_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# request fields that map one to one onto SamplingParams
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "ignore_eos")


class RequestError(ValueError):
    """The request is invalid; the message says which field and why."""


@dataclass(frozen=True)
class ChatModel:
    """What request parsing needs to know about the served model."""

    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict


@dataclass(frozen=True)
class ChatRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]


def parse_chat_request(data, model: ChatModel) -> ChatRequest:
    if not isinstance(data, dict):
        raise RequestError(f"request data must be a map, got {type_name(data)}")
    messages = parse_messages(data.get("messages"))
    prompt = render_prompt(model.tokenizer, messages, data)
    prompt_token_ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    check_prompt_length(len(prompt_token_ids), model.max_model_len)
    if data.get("n") not in (None, 1):
        raise RequestError(f"n: only n=1 is supported, got {data['n']!r}")
    fields = {**model.sampling_defaults, **{k: v for k, v in data.items() if v is not None}}
    max_tokens = parse_max_tokens(data, fields, len(prompt_token_ids), model.max_model_len)
    sampling = {name: fields[name] for name in SAMPLING_FIELDS if name in fields}
    ignore_eos = sampling.get("ignore_eos") is True
    try:  # SamplingParams checks the types and ranges and names the field
        params = SamplingParams(
            **sampling, max_tokens=max_tokens, stop_token_ids=() if ignore_eos else model.eos_token_ids
        )
    except ValueError as exc:
        raise RequestError(str(exc)) from exc
    return ChatRequest(prompt_token_ids, params, parse_stop(data.get("stop")))


def parse_messages(messages) -> list[dict]:
    if messages is None:
        raise RequestError("messages is required")
    if not isinstance(messages, list):
        raise RequestError(f"messages must be a list of messages, got {type_name(messages)}")
    if not messages:
        raise RequestError("messages must not be empty")
    return [parse_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def parse_message(message, where: str) -> dict:
    """A copy with a string role (default "user") and string content; other keys pass to the template."""
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be a map with role and content, got {type_name(message)}")
    role = message.get("role") or "user"
    if not isinstance(role, str):
        raise RequestError(f"{where}.role must be a string, got {type_name(role)}")
    return {**message, "role": role, "content": message_text(message.get("content"), f"{where}.content")}


def message_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts, got {type_name(content)}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type", "text") not in TEXT_PART_TYPES:
            kind = part.get("type") if isinstance(part, dict) else type_name(part)
            raise RequestError(f"{where}[{i}]: only text parts are supported, got {kind}")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{i}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict], data: dict) -> str:
    kwargs = data.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError(f"chat_template_kwargs must be a map, got {type_name(kwargs)}")
    add_generation_prompt = optional(data, "add_generation_prompt", bool, True)
    if tokenizer.chat_template is None:
        raise RequestError("the model has no chat template, so it cannot serve chat completions")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # a template raises whatever its author chose: all of them are the request's fault
        raise RequestError(f"messages: the chat template rejected them: {exc}") from exc


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"messages: the prompt is {num_prompt_tokens} tokens, which leaves no room to generate within "
            f"the model's maximum context length of {max_model_len} tokens; shorten the messages"
        )


def parse_max_tokens(data: dict, fields: dict, num_prompt_tokens: int, max_model_len: int) -> int:
    room = max_model_len - num_prompt_tokens
    for name in ("max_completion_tokens", "max_tokens"):
        if data.get(name) is not None:
            requested = integer(data, name)
            if requested < 1:
                raise RequestError(f"{name} must be at least 1, got {requested}")
            if requested > room:
                raise RequestError(
                    f"{name}: this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens} "
                    f"prompt tokens plus {requested} completion tokens is {num_prompt_tokens + requested}; "
                    f"reduce {name} or the messages"
                )
            return requested
    default = fields.get("max_tokens")
    return min(room, default) if isinstance(default, int) and default >= 1 else room


def parse_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    return tuple(stops)


def integer(fields: dict, name: str) -> int:
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    return value


def optional(fields: dict, name: str, kind: type, default):
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise RequestError(f"{name} must be a {kind.__name__}, got {value!r}")
    return value


def sampling_defaults(model_dir: str) -> dict:
    """Sampling defaults from the model's generation_config.json."""
    config = read_generation_config(model_dir)
    return {field: config[key] for key, field in GENERATION_CONFIG_DEFAULTS.items() if config.get(key) is not None}


def type_name(value) -> str:
    return "nil" if value is None else type(value).__name__
