"""An engine stand-in for the handler's Service: it records what reaches it and finishes each request at once with
one token, or raises the failure a test sets for the next submit."""
import asyncio
from types import SimpleNamespace


class FakeWorker:
    kind, eos_token_ids, max_model_len, max_embedding_tokens, reads_images = "decoder", (), 2048, 2048, False

    def __init__(self, model_dir: str, vocab_size: int = 49152):
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.submitted: list[str] = []
        self.failure: Exception | None = None  # raised by the next submit, once

    def submit(self, request_id, prompt_token_ids, params, constraint=None, queue=None, shares_prompt_with=None,
               images=()):
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
        self.submitted.append(request_id)
        outputs = queue or asyncio.Queue()
        outputs.put_nowait(SimpleNamespace(request_id=request_id, new_token_ids=[42], finish_reason="length",
                                           error=None, logprobs=None, prompt_logprobs=None))
        return outputs

    def stats(self) -> dict:
        return {"running": 0, "waiting": 0, "num_free_blocks": 1, "num_total_blocks": 1,
                "prefix_cache_hit_rate": 0.0, "num_preemptions": 0}

    def abort(self, request_id):
        pass
