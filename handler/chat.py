"""An OpenAI chat completion request -> prompt token ids, sampling parameters and stop strings.

The request's types and ranges are schema/chat.py's; here, what needs the model or the operator's caps. Every
problem raises RequestError with a message naming the field (and `param`, for OpenAI's error object); the
protocol layer sends it back as the request's error reply, status 400. Defaults follow vLLM's
OpenAI server: sampling fields the request leaves out come from the model's generation_config.json, then from
SamplingParams; max_tokens defaults to the rest of the context.
"""

import json
import math
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from daemon_protocol import RequestError
from engine import SamplingParams
from handler.grammar import Grammars
from handler.images import IMAGE_PART_TYPE, VisionPrompt
from handler.limits import RequestLimits, nesting_depth_over
from handler.output_plan import OutputPlan, plan_output, with_prompt
from handler.tools import prepare_tool_turns
from models.model_files import read_generation_config
from schema import ChatCompletionRequest, Message, decode, type_name
from schema.chat import ContentPart, Sampling

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
# request fields that map one to one onto SamplingParams (their types and ranges: schema/chat.py)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "ignore_eos")
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
    grammars: Grammars | None = None  # None: no grammar-constrained output
    max_chars_per_token: int | None = None  # from max_chars_per_token(tokenizer); None: no bound before tokenizing
    trust_request_chat_template: bool = False  # HFENDPOINT_TRUST_REQUEST_CHAT_TEMPLATE
    vision: VisionPrompt | None = None  # of a model that reads images; None: image parts refused
    limits: RequestLimits = field(default_factory=RequestLimits)  # HFENDPOINT_MAX_...


@dataclass(frozen=True)
class ChatRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    output: OutputPlan | None = None  # choices, grammar, tool calls, reasoning
    images: tuple = ()  # engine.images.PromptImage of each image part, in prompt order


def parse_chat_request(data, model: ChatModel, image_sources: list = ()) -> ChatRequest:
    """image_sources: the request's image parts, gathered (handler/images.py's ImageFetcher); decoded and
    preprocessed here, on the encoding thread."""
    request = decode_request(data, ChatCompletionRequest, model.limits)
    messages = template_messages(data["messages"], request.messages, model.vision is not None)
    messages = prepare_tool_turns(messages, request.messages)
    check_nesting(messages, model.limits, "messages")  # tool-call arguments, parsed from their JSON strings
    output = plan_output(request, data.get("tools"), model)
    stop = check_stop(request.stop_strings(), model.limits)
    prompt = render_prompt(model.tokenizer, messages, request, output.tools.template_tools,
                           model.trust_request_chat_template)
    images = ()
    if image_sources:
        images = tuple(model.vision.prepare(source) for source in image_sources)
        prompt = model.vision.expand(prompt, list(images))
    check_prompt_chars(len(prompt), model)
    check_rendered_size(len(prompt), model.limits)
    prompt_token_ids = encode_prompt(model.tokenizer, prompt)
    check_prompt_length(len(prompt_token_ids), model.max_model_len)
    max_tokens = checked_max_tokens(request, model.sampling_defaults, len(prompt_token_ids), model.max_model_len)
    params = sampling_params(request, model, {**output.sampling, "max_tokens": max_tokens})
    return ChatRequest(prompt_token_ids, params, stop, with_prompt(output, model.tokenizer.chat_template, prompt),
                       images)


def decode_request(data, kind: type, limits: RequestLimits):
    """The request's map as `kind` (schema/), after its nesting is checked: nothing walks it recursively first."""
    check_nesting(data, limits)
    return decode(data, kind)


def sampling_params(request: Sampling, model: ChatModel, settings: dict,
                    defaults: dict | None = None) -> SamplingParams:
    """SamplingParams from the request's sampling fields (SAMPLING_FIELDS, over the model's defaults) and the
    settings the request's other fields make (max_tokens, logprobs, ...). The schema has checked every value."""
    defaults = model.sampling_defaults if defaults is None else defaults
    sampling = {name: defaults[name] for name in SAMPLING_FIELDS if name in defaults}
    sampling.update((name, getattr(request, name)) for name in SAMPLING_FIELDS if getattr(request, name) is not None)
    return SamplingParams(**sampling, **settings, stop_token_ids=() if request.ignore_eos else model.eos_token_ids)


def check_nesting(value, limits: RequestLimits, where: str | None = None) -> None:
    """Lists and maps nested deeper than the operator allows are refused before anything walks them
    recursively (the schema's decoding, the template's tojson, the grammar compiler, a JSON encoder)."""
    if not nesting_depth_over(value, limits.max_nesting_depth):
        return
    if where is None and isinstance(value, dict):  # name the top-level field that nests too deeply
        where = next((name for name, item in value.items() if nesting_depth_over(item, limits.max_nesting_depth - 1)),
                     None)
    raise RequestError(f"{where or 'the request'} nests lists and maps more than {limits.max_nesting_depth} levels "
                       "deep (HFENDPOINT_MAX_NESTING_DEPTH); flatten it", param=where)


def template_messages(sent: list[dict], messages: list[Message], reads_images: bool = False) -> list[dict]:
    """Copies of the messages as sent (their other keys pass to the template), with a known role (developer
    becomes system) and string content (with image parts, when the model reads images, the list of text and
    {"type": "image"} parts multimodal templates read)."""
    return [{**message, "role": TEMPLATE_ROLES.get(typed.speaker, typed.speaker),
             "content": template_content(typed.content, f"messages[{i}].content", reads_images)}
            for i, (message, typed) in enumerate(zip(sent, messages))]


def template_content(content: str | list[ContentPart] | None, where: str, reads_images: bool) -> str | list[dict]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if reads_images and any(part.type == IMAGE_PART_TYPE for part in content):
        return [{"type": "image"} if part.type == IMAGE_PART_TYPE else
                {"type": "text", "text": part_text(part, f"{where}[{i}]")} for i, part in enumerate(content)]
    return "\n".join(part_text(part, f"{where}[{i}]") for i, part in enumerate(content))


def part_text(part: ContentPart, where: str) -> str:
    if part.type == IMAGE_PART_TYPE:
        raise RequestError(f"{where}: this model does not read images (image_url parts)", param="messages")
    if part.type not in TEXT_PART_TYPES:
        raise RequestError(f"{where}: only text parts are supported, got {part.type}", param="messages")
    if part.text is None:
        raise RequestError(f"{where}.text must be a string", param="messages")
    return part.text


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict], request: ChatCompletionRequest,
                  tools: list[dict] | None = None, trust_templates: bool = False) -> str:
    kwargs = request.chat_template_kwargs or {}
    kwargs = {**kwargs, **request_template(request.chat_template, kwargs, trust_templates)}
    if tokenizer.chat_template is None:
        raise RequestError("the model has no chat template, so it cannot serve chat completions")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=request.add_generation_prompt, **kwargs
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


def request_template(chat_template: str | None, kwargs: dict, trusted: bool) -> dict:
    """A template sent with the request ({"chat_template": ...} as apply_chat_template takes it, or {}). A template
    is a program: one loop in it holds an encoding thread for as long as it likes, so the request's own templates
    are refused unless the operator trusts its clients (as vLLM does)."""
    sent = {name: value for name, value in (("chat_template", chat_template),
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


def checked_max_tokens(request: Sampling, defaults: dict, num_prompt_tokens: int, max_model_len: int) -> int:
    """The request's max_completion_tokens or max_tokens, which must fit the context; else the default (defaults'
    max_tokens) cut to the room left, or all of it."""
    room = max_model_len - num_prompt_tokens
    for name in ("max_completion_tokens", "max_tokens"):
        requested = getattr(request, name, None)
        if requested is not None:
            if requested > room:
                raise RequestError(
                    f"{name}: this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens} "
                    f"prompt tokens plus {requested} completion tokens is {num_prompt_tokens + requested}; "
                    f"reduce {name} or the messages", param=name, code="context_length_exceeded")
            return requested
    default = defaults.get("max_tokens")
    return min(room, default) if isinstance(default, int) and default >= 1 else room


def check_stop(stops: tuple[str, ...], limits: RequestLimits) -> tuple[str, ...]:
    """The stop strings (their types checked by the schema), within the operator's caps."""
    if len(stops) > limits.max_stop_strings:
        raise RequestError(f"stop: at most {limits.max_stop_strings} stop strings (HFENDPOINT_MAX_STOP_STRINGS), "
                           f"got {len(stops)}", param="stop")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_chars:
        raise RequestError(f"stop: a stop string is at most {limits.max_stop_chars} characters "
                           f"(HFENDPOINT_MAX_STOP_CHARS), got one of {longest}", param="stop")
    return stops


def sampling_defaults(model_dir: str) -> dict:
    """Sampling defaults from the model's generation_config.json."""
    config = read_generation_config(model_dir)
    return {name: config[key] for key, name in GENERATION_CONFIG_DEFAULTS.items() if config.get(key) is not None}
