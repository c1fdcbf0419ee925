"""OpenAI's logprobs entries from the engine's per-token logprobs.

Each entry names a token by its text and its exact bytes (`bytes`): a token that holds part of a UTF-8
character shows its bytes escaped (`\\xe2\\x80`) in `token`, and `bytes` lets a client join them. A logprob the
engine reports as minus infinity (a token the grammar or logit_bias rules out) is sent as -9999.0, as OpenAI
does, since JSON has no infinity.
"""
import math

FLOOR = -9999.0


class LogprobEntries:
    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes  # by token id (xgrammar's decoded vocabulary)

    def entries(self, token_ids: list[int], logprobs: list) -> list[dict]:
        """One entry per token: logprobs[i] is the engine's (logprob, top token ids, their logprobs)."""
        return [{**self.entry(token_id, logprob),
                 "top_logprobs": [self.entry(top_id, top) for top_id, top in zip(top_ids, top_logprobs)]}
                for token_id, (logprob, top_ids, top_logprobs) in zip(token_ids, logprobs)]

    def entry(self, token_id: int, logprob: float) -> dict:
        raw = self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""
        return {"token": raw.decode("utf-8", errors="backslashreplace"), "logprob": finite(logprob),
                "bytes": list(raw)}


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR
