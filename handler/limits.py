"""What one request may make the handler build: the operator's caps on every request field that sizes a
structure (choices, alternatives per token, biases, tools, stop strings, schemas, grammars, prompts).

Each cap is a HFENDPOINT_MAX_... variable (README's configuration table); a request over one gets a 400
naming its field, so that no request's own structures can grow past what the operator allows the process.
The defaults are generous: a legitimate client never meets them.
"""
import os
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16                          # HFENDPOINT_MAX_N: choices of one chat request
    max_top_logprobs: int = 20               # HFENDPOINT_MAX_TOP_LOGPROBS
    max_logit_bias_entries: int = 1024       # HFENDPOINT_MAX_LOGIT_BIAS_ENTRIES
    max_tools: int = 512                     # HFENDPOINT_MAX_TOOLS
    max_stop_strings: int = 16               # HFENDPOINT_MAX_STOP_STRINGS
    max_stop_chars: int = 1024               # HFENDPOINT_MAX_STOP_CHARS: characters of one stop string
    max_schema_bytes: int = 256 << 10        # HFENDPOINT_MAX_SCHEMA_BYTES: a response_format or tools schema, as JSON
    grammar_compile_timeout: float = 10.0    # HFENDPOINT_GRAMMAR_COMPILE_TIMEOUT: seconds one grammar may compile
    max_grammar_bytes: int = 8 << 20         # HFENDPOINT_MAX_GRAMMAR_BYTES: one compiled grammar, in memory
    max_nesting_depth: int = 100             # HFENDPOINT_MAX_NESTING_DEPTH: lists and maps in a request
    max_prompt_chars: int = 8 << 20          # HFENDPOINT_MAX_PROMPT_CHARS: a rendered chat prompt

    @classmethod
    def from_env(cls, env=os.environ) -> "RequestLimits":
        """A bad value raises ValueError naming the variable."""
        values = {}
        for spec in fields(cls):
            name = f"HFENDPOINT_{spec.name.upper()}"
            raw = env.get(name)
            if raw is None:
                continue
            try:
                value = spec.type(raw)
            except ValueError:
                value = 0
            if not 0 < value < float("inf"):
                raise ValueError(f"{name}={raw!r} is invalid: expected a positive {spec.type.__name__}")
            values[spec.name] = value
        return cls(**values)


def nesting_depth_over(value, limit: int) -> bool:
    """Whether lists and maps nest deeper than limit in value; walked without recursion, so a value nested
    deeper than Python's recursion limit is measured too, and stopped at the first level past the limit."""
    level = [value]
    for _ in range(limit + 1):
        level = [child for item in level if isinstance(item, (list, dict))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return False
    return True
