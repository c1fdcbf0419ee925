"""An OpenAI chat completion request -> prompt token ids, sampling parameters and stop strings.

Every problem raises RequestError with a message naming the field (and `param`, for OpenAI's error
object); the protocol layer sends it back as the request's error reply, status 400. Defaults follow vLLM's
OpenAI server: sampling fields the request leaves out come from the model's generation_config.json, then from
SamplingParams; max_tokens defaults to the rest of the context.
"""

import json
import math
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from daemon_protocol import RequestError
from engine import SamplingParams
from handler.images import is_image_part
from handler.limits import RequestLimits, nesting_depth_over
from models.model_files import read_generation_config

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
# The type of each request field that is read here or only passed along; checked before any value is used,
# so that a wrong type is a 400 naming the field and the expected type. Ranges are SamplingParams' to check.
FIELD_TYPES = {
    "temperature": "number", "top_p": "number", "min_p": "number", "presence_penalty": "number",
    "frequency_penalty": "number", "repetition_penalty": "number",
    "top_k": "integer", "seed": "integer", "max_tokens": "integer", "max_completion_tokens": "integer",
    "n": "integer",
    "ignore_eos": "boolean", "add_generation_prompt": "boolean", "stream": "boolean", "store": "boolean",
    "model": "string", "user": "string", "service_tier": "string",
    "stream_options": "map", "chat_template_kwargs": "map", "metadata": "map",
}
ROLES = ("system", "user", "assistant", "tool", "developer")
TEMPLATE_ROLES = {"developer": "system"}  # OpenAI's newer name for system messages, which templates know
TRUST_TEMPLATES_VARIABLE = "HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE"
# Normalizers by how many characters of text at most become one normalized character: composition (NFC, NFKC)
# merges at most 4 (the longest canonical decomposition). Those that may delete any amount of text (Strip,
# StripAccents, BertNormalizer, Nmt, Precompiled) are absent: under them a prompt's length bounds nothing.
NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1}
# Pre-tokenizers that keep every character of the text (Split unless its behavior is "Removed")
KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Split", "Digits", "Punctuation")



@dataclass(frozen=True)
class ChatModel:
    """What request parsing needs to know about the served model."""

    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict
    vocab_size: int | None = None  # the LM head's rows (default: the tokenizer's size)
    grammars: object = None  # handler.grammar.Grammars; None: no grammar-constrained output
    max_chars_per_token: int | None = None  # from max_chars_per_token(tokenizer); None: no bound before tokenizing
    trust_request_chat_template: bool = False  # HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE
    vision: object = None  # handler.images.VisionPrompt of a model that reads images; None: image parts refused
    limits: RequestLimits = field(default_factory=RequestLimits)  # HFENDPOINT_MAX_...


@dataclass(frozen=True)
class ChatRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    output: object = None  # handler.output_plan.OutputPlan: choices, grammar, tool calls, reasoning
    images: tuple = ()  # engine.images.PromptImage of each image part, in prompt order


def parse_chat_request(data, model: ChatModel, image_sources: list = ()) -> ChatRequest:
    """image_sources: the request's image parts, gathered (handler/images.py's ImageFetcher); decoded and
    preprocessed here, on the encoding thread."""
    if not isinstance(data, dict):
        raise RequestError(f"request data must be a map, got {type_name(data)}")
    check_nesting(data, model.limits)
    check_field_types(data)
    from handler.output_plan import plan_output, with_prompt  # here: those modules import this one's helpers
    from handler.tools import prepare_tool_turns
    messages = prepare_tool_turns(parse_messages(data.get("messages"), model.vision is not None))
    check_nesting(messages, model.limits, "messages")  # tool-call arguments, parsed from their JSON strings
    output = plan_output(data, model)
    stop = parse_stop(data.get("stop"), model.limits)
    prompt = render_prompt(model.tokenizer, messages, data, output.tools.template_tools,
                           model.trust_request_chat_template)
    images = ()
    if image_sources:
        images = tuple(model.vision.prepare(source) for source in image_sources)
        prompt = model.vision.expand(prompt, list(images))
    check_prompt_chars(len(prompt), model)
    check_rendered_size(len(prompt), model.limits)
    prompt_token_ids = encode_prompt(model.tokenizer, prompt)
    check_prompt_length(len(prompt_token_ids), model.max_model_len)
    fields = {**model.sampling_defaults, **{k: v for k, v in data.items() if v is not None}}
    max_tokens = parse_max_tokens(data, fields, len(prompt_token_ids), model.max_model_len)
    params = sampling_params(fields, {**output.sampling, "max_tokens": max_tokens}, model)
    return ChatRequest(prompt_token_ids, params, stop, with_prompt(output, model.tokenizer.chat_template, prompt),
                       images)


def sampling_params(fields: dict, settings: dict, model: ChatModel) -> SamplingParams:
    """SamplingParams from the request's sampling fields (SAMPLING_FIELDS, over the model's defaults) and the
    settings the request's other fields make (max_tokens, logprobs, ...)."""
    sampling = {name: fields[name] for name in SAMPLING_FIELDS if name in fields}
    ignore_eos = sampling.get("ignore_eos") is True
    try:  # SamplingParams checks the types and ranges and names the field
        return SamplingParams(**sampling, **settings, stop_token_ids=() if ignore_eos else model.eos_token_ids)
    except ValueError as exc:  # its messages start with the field's name
        at_fault = next((name for name in (*sampling, *settings) if str(exc).startswith(f"{name} ")), None)
        raise RequestError(str(exc), param=at_fault) from exc


def check_nesting(value, limits: RequestLimits, where: str | None = None) -> None:
    """Lists and maps nested deeper than the operator allows are refused before anything walks them
    recursively (the template's tojson, the grammar compiler, a JSON encoder)."""
    if not nesting_depth_over(value, limits.max_nesting_depth):
        return
    if where is None:  # name the top-level field that nests too deeply
        where = next((name for name, item in value.items() if nesting_depth_over(item, limits.max_nesting_depth - 1)),
                     None)
    raise RequestError(f"{where or 'the request'} nests lists and maps more than {limits.max_nesting_depth} levels "
                       "deep (HFENDPOINT_MAX_NESTING_DEPTH); flatten it", param=where)


def check_field_types(data: dict) -> None:
    for name, kind in FIELD_TYPES.items():
        value = data.get(name)
        if value is not None and not is_a(value, kind):
            raise RequestError(f"{name} must be {'an' if kind == 'integer' else 'a'} {kind}, got {value!r}",
                               param=name)
        if kind == "number" and value is not None and not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value!r}", param=name)


def is_a(value, kind: str) -> bool:
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {"boolean": bool, "string": str, "map": dict}[kind])


def parse_messages(messages, reads_images: bool = False) -> list[dict]:
    if messages is None:
        raise RequestError("messages is required", param="messages")
    if not isinstance(messages, list):
        raise RequestError(f"messages must be a list of messages, got {type_name(messages)}", param="messages")
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    return [parse_message(message, f"messages[{i}]", reads_images) for i, message in enumerate(messages)]


def parse_message(message, where: str, reads_images: bool = False) -> dict:
    """A copy with a known role (default "user"; developer becomes system) and string content (with image parts,
    when the model reads images, the list of text and {"type": "image"} parts multimodal templates read); other
    keys pass to the template."""
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be a map with role and content, got {type_name(message)}", param="messages")
    role = message.get("role")
    if role is None:  # absent or null: the user speaks
        role = "user"
    if not isinstance(role, str):
        raise RequestError(f"{where}.role must be a string, got {type_name(role)}", param="messages")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param="messages")
    if message.get("name") is not None and not isinstance(message["name"], str):
        raise RequestError(f"{where}.name must be a string, got {type_name(message['name'])}", param="messages")
    content = message.get("content")
    if reads_images and isinstance(content, list) and any(map(is_image_part, content)):
        parts = [{"type": "image"} if is_image_part(part) else
                 {"type": "text", "text": part_text(part, f"{where}.content[{i}]")} for i, part in enumerate(content)]
        return {**message, "role": TEMPLATE_ROLES.get(role, role), "content": parts}
    return {**message, "role": TEMPLATE_ROLES.get(role, role),
            "content": message_text(content, f"{where}.content")}


def message_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts, got {type_name(content)}",
                           param="messages")
    return "\n".join(part_text(part, f"{where}[{i}]") for i, part in enumerate(content))


def part_text(part, where: str) -> str:
    if is_image_part(part):
        raise RequestError(f"{where}: this model does not read images (image_url parts)", param="messages")
    if not isinstance(part, dict) or part.get("type", "text") not in TEXT_PART_TYPES:
        kind = part.get("type") if isinstance(part, dict) else type_name(part)
        raise RequestError(f"{where}: only text parts are supported, got {kind}", param="messages")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text must be a string", param="messages")
    return part["text"]


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict], data: dict,
                  tools: list[dict] | None = None, trust_templates: bool = False) -> str:
    kwargs = data.get("chat_template_kwargs") or {}
    kwargs = {**kwargs, **request_template(data, kwargs, trust_templates)}
    add_generation_prompt = data.get("add_generation_prompt") is not False
    if tokenizer.chat_template is None:
        raise RequestError("the model has no chat template, so it cannot serve chat completions")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # a template raises whatever its author chose: all of them are the request's fault
        raise RequestError(f"messages: the chat template rejected them: {exc}", param="messages") from exc


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, add_special_tokens: bool = False) -> list[int]:
    """A rendered prompt's ids; the template has written its special tokens already (a raw prompt takes the
    tokenizer's own with add_special_tokens, as a legacy completion's does). Straight from the Rust
    tokenizer, without the character offsets that tokenizer(prompt) computes and throws away, and with the GIL
    released while it runs. An embedding input with truncate_prompt_tokens leaves truncation set on this
    thread's tokenizer (handler/tokenizer.py): it is turned off, as tokenizer(prompt) would, so no prompt is cut."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    return backend.encode_batch_fast([prompt], add_special_tokens=add_special_tokens)[0].ids


def request_template(data: dict, kwargs: dict, trusted: bool) -> dict:
    """A template sent with the request ({"chat_template": ...} as apply_chat_template takes it, or {}). A template
    is a program: one loop in it holds an encoding thread for as long as it likes, so the request's own templates
    are refused unless the operator trusts its clients (as vLLM does)."""
    sent = {name: value for name, value in (("chat_template", data.get("chat_template")),
                                            ("chat_template_kwargs.chat_template", kwargs.get("chat_template")))
            if value is not None}
    for name, value in sent.items():
        if not trusted:
            raise RequestError(f"{name}: this server does not run chat templates sent with requests; its operator "
                               f"can allow them with {TRUST_TEMPLATES_VARIABLE}=true", param=name)
        if not isinstance(value, str):
            raise RequestError(f"{name} must be a string, got {type_name(value)}", param=name)
    return {"chat_template": sent["chat_template"]} if "chat_template" in sent else {}


def max_chars_per_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most characters of text one token can stand for, so that a text of C characters has at least C / that
    many tokens: the longest vocabulary entry, times what the normalizer may shrink the text by. None when no such
    bound holds: when a character may have no token of its own (neither byte-level nor byte fallback, so an unknown
    token stands for any run), or the normalizer, a pre-tokenizer or a special token's lstrip/rstrip may drop text."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    pre_tokenizers = component_chain(spec.get("pre_tokenizer"), "pretokenizers")
    spells_every_character = spec["model"].get("byte_fallback") or any(p["type"] == "ByteLevel" for p in pre_tokenizers)
    keeps_every_character = all(p["type"] in KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed"
                                for p in pre_tokenizers)
    strips = any(token.get("lstrip") or token.get("rstrip") for token in spec.get("added_tokens") or [])
    shrinks = [normalizer_shrink(normalizer) for normalizer in component_chain(spec.get("normalizer"), "normalizers")]
    if not (spells_every_character and keeps_every_character) or strips or None in shrinks:
        return None
    return math.prod(shrinks) * max(map(len, tokenizer.get_vocab()))


def component_chain(spec: dict | None, members: str) -> list[dict]:
    """A tokenizer.json normalizer or pre-tokenizer as the list of its parts (a Sequence flattened)."""
    if spec is None:
        return []
    if spec["type"] == "Sequence":
        return [part for member in spec[members] for part in component_chain(member, members)]
    return [spec]


def normalizer_shrink(spec: dict) -> int | None:
    """At most how many characters one normalizer turns into one (NORMALIZER_SHRINK); a Replace of a plain string
    by a shorter one shrinks by their ratio, a Replace of a pattern by anything is unbounded."""
    if spec["type"] == "Replace":
        pattern, content = spec["pattern"].get("String"), spec.get("content", "")
        return math.ceil(len(pattern) / len(content)) if pattern and content else None
    return NORMALIZER_SHRINK.get(spec["type"])


def check_prompt_chars(num_prompt_chars: int, model: ChatModel) -> None:
    """Refuses, before tokenizing it, a prompt too long in characters to fit the context whatever its tokens."""
    if model.max_chars_per_token is None:
        return
    at_least = -(-num_prompt_chars // model.max_chars_per_token)
    if at_least >= model.max_model_len:
        raise RequestError(
            f"messages: the prompt is {num_prompt_chars} characters, at least {at_least} tokens, which leaves no "
            f"room to generate within the model's maximum context length of {model.max_model_len} tokens; "
            "shorten the messages", param="messages", code="context_length_exceeded"
        )


def check_rendered_size(num_prompt_chars: int, limits: RequestLimits) -> None:
    """A template's output past the operator's bound is refused: a (trusted) template may write any amount."""
    if num_prompt_chars > limits.max_prompt_chars:
        raise RequestError(f"messages: the chat template wrote a prompt of {num_prompt_chars} characters, more than "
                           f"this server's {limits.max_prompt_chars} (HFENDPOINT_MAX_PROMPT_CHARS)",
                           param="messages", code="context_length_exceeded")


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"messages: the prompt is {num_prompt_tokens} tokens, which leaves no room to generate within "
            f"the model's maximum context length of {max_model_len} tokens; shorten the messages",
            param="messages", code="context_length_exceeded")


def parse_max_tokens(data: dict, fields: dict, num_prompt_tokens: int, max_model_len: int) -> int:
    room = max_model_len - num_prompt_tokens
    for name in ("max_completion_tokens", "max_tokens"):
        if data.get(name) is not None:
            requested = data[name]  # an integer: check_field_types
            if requested < 1:
                raise RequestError(f"{name} must be at least 1, got {requested}", param=name)
            if requested > room:
                raise RequestError(
                    f"{name}: this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens} "
                    f"prompt tokens plus {requested} completion tokens is {num_prompt_tokens + requested}; "
                    f"reduce {name} or the messages", param=name, code="context_length_exceeded")
            return requested
    default = fields.get("max_tokens")
    return min(room, default) if isinstance(default, int) and default >= 1 else room


def parse_stop(stop, limits: RequestLimits) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r:.100}",
                           param="stop")
    if len(stops) > limits.max_stop_strings:
        raise RequestError(f"stop: at most {limits.max_stop_strings} stop strings (HFENDPOINT_MAX_STOP_STRINGS), "
                           f"got {len(stops)}", param="stop")
    longest = max(map(len, stops))
    if longest > limits.max_stop_chars:
        raise RequestError(f"stop: a stop string is at most {limits.max_stop_chars} characters "
                           f"(HFENDPOINT_MAX_STOP_CHARS), got one of {longest}", param="stop")
    return tuple(stops)


def sampling_defaults(model_dir: str) -> dict:
    """Sampling defaults from the model's generation_config.json."""
    config = read_generation_config(model_dir)
    return {name: config[key] for key, name in GENERATION_CONFIG_DEFAULTS.items() if config.get(key) is not None}


def integer(fields: dict, name: str) -> int:
    value = fields[name]
    if not is_a(value, "integer"):
        raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    return value


def type_name(value) -> str:
    return "nil" if value is None else type(value).__name__
