"""`python -m handler.grammar_worker`: a child process that compiles JSON schemas into xgrammar grammars.

A compile cannot be interrupted inside a thread, and some schemas take minutes: in a process of its own, the
handler (handler/grammar_compiler.py) kills it when its request runs out of time or is cancelled, or when the
handler exits, and reads the library's warnings (printed by its C++ code straight to stderr) from a pipe.

    python -m handler.grammar_worker MAX_GRAMMAR_BYTES

Over stdin: the served tokenizer's TokenizerInfo as one JSON line, then one JSON schema per line. Over
stdout, one line per schema: "grammar " and CompiledGrammar.serialize_json() (one line of JSON), or "error "
and the message.
A grammar whose first step allows no token (a schema no string satisfies, such as {"$ref": "#"}) is an
error too, found here rather than by the engine, and so is a compiled grammar larger than MAX_GRAMMAR_BYTES
(a short schema can compile to hundreds of MB: an enum of thousands of strings).
The process runs at a lower priority, on one thread: the handler's engine and encoding come first.
"""
import ctypes
import os
import signal
import sys

import xgrammar

from handler.library_warnings import LIBRARY_PREFIX

PR_SET_PDEATHSIG = 1
NICENESS = 10


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the handler dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def compile_schema(compiler: xgrammar.GrammarCompiler, info: xgrammar.TokenizerInfo, schema: str,
                   max_bytes: int) -> str:
    """The answer line for one schema, without its newline."""
    try:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = " ".join(LIBRARY_PREFIX.sub("", str(exc)).split())
        return f"error xgrammar cannot compile this JSON schema: {message}"
    if compiled.memory_size_bytes > max_bytes:
        return (f"error this JSON schema compiles to a grammar of {compiled.memory_size_bytes >> 10} KiB, more than "
                f"this server's {max_bytes >> 10} KiB (HFENDPOINT_MAX_GRAMMAR_BYTES); simplify it")
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not bitmask.any():
        return ("error no JSON value satisfies this schema (its grammar allows no first token; a $ref that refers to "
                "itself without a way out, for example)")
    return f"grammar {compiled.serialize_json()}"


def main() -> None:
    die_with_parent()
    os.nice(NICENESS)
    max_bytes = int(sys.argv[1])
    info = xgrammar.TokenizerInfo.deserialize_json(sys.stdin.readline())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the handler keeps the results
    for line in sys.stdin:
        sys.stdout.write(compile_schema(compiler, info, line, max_bytes) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
