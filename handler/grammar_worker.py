"""`python -m handler.grammar_worker`: a child process that compiles JSON schemas into xgrammar grammars.

A compile cannot be interrupted inside a thread, and some schemas take minutes: in a process of its own, the
handler (handler/grammar_compiler.py) kills it when its request runs out of time or is cancelled, or when the
handler exits, and reads the library's warnings (printed by its C++ code straight to stderr) from a pipe.

Over stdin: the served tokenizer's TokenizerInfo as one JSON line, then one JSON schema per line. Over
stdout, one JSON line per schema: {"grammar": <CompiledGrammar.serialize_json()>} or {"error": <message>}.
A grammar whose first step allows no token (a schema no string satisfies, such as {"$ref": "#"}) is an
error too, found here rather than by the engine.
"""
import ctypes
import json
import signal
import sys

import xgrammar

from handler.library_warnings import LIBRARY_PREFIX

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the handler dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def compile_schema(compiler: xgrammar.GrammarCompiler, info: xgrammar.TokenizerInfo, schema: str) -> dict:
    try:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        return {"error": f"xgrammar cannot compile this JSON schema: {LIBRARY_PREFIX.sub('', str(exc)).strip()}"}
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not bitmask.any():
        return {"error": "no JSON value satisfies this schema (its grammar allows no first token; a $ref that "
                         "refers to itself without a way out, for example)"}
    return {"grammar": compiled.serialize_json()}


def main() -> None:
    die_with_parent()
    info = xgrammar.TokenizerInfo.deserialize_json(sys.stdin.readline())
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # the handler keeps what it compiled
    for line in sys.stdin:
        sys.stdout.write(json.dumps(compile_schema(compiler, info, line)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
