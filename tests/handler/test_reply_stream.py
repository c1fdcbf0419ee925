"""A chat request's chunks sent from the engine's step callback (handler/reply_stream.py): the chunks its task
would yield, in their order, while its reply sink is ready; the task yields the rest; a failure met in the callback
is raised by the task."""
import asyncio
from types import SimpleNamespace

import pytest

from engine import RequestOutput
from handler.choices import ChatReplies
from handler.logs import RequestLog
from handler.output_plan import OutputPlan


class Sink:
    def __init__(self, readiness: list[bool]):
        self.readiness = readiness  # whether it is ready, step by step (then not)
        self.chunks = []
        self.sent = []  # every chunk that reached the client, the task's yielded ones too, in order

    @property
    def ready(self) -> bool:
        return bool(self.readiness) and self.readiness[0]

    def send(self, payload) -> None:
        self.chunks.append(payload)
        self.sent.append(payload)


class StepWorker:
    """Takes submissions; deliver() hands a step's outputs over as the engine's callback does, outside the task."""

    def __init__(self):
        self.queues, self.aborted = {}, []

    def submit(self, request_id, prompt_token_ids, params, constraint=None, queue=None, shares_prompt_with=None,
               images=()):
        self.queues[request_id] = queue

    def abort(self, request_id):
        self.aborted.append(request_id)

    def deliver(self, outputs):
        for output in outputs:
            self.queues[output.request_id].put_nowait(output)


def steps_of(token_lists: dict, finish_reason: str) -> list[list[RequestOutput]]:
    """One output per choice per step, each choice's last with finish_reason."""
    steps = []
    for step in range(max(map(len, token_lists.values()))):
        steps.append([RequestOutput(choice_id, [tokens[step]], finish_reason if step == len(tokens) - 1 else None,
                                    None, 3, step + 1, 0) for choice_id, tokens in token_lists.items()
                      if step < len(tokens)])
    return steps


def serve(replies, plan: OutputPlan, steps, sink=None, stop=(), turns=None):
    """(chunks the task yielded, chunks sent to the sink, the worker); the event loop turns turns[i] times after
    step i (default: 10, enough for the task to yield all it has)."""
    async def main():
        worker = StepWorker()
        request = SimpleNamespace(prompt_token_ids=[1, 2, 3], stop=stop, output=plan, params=SimpleNamespace(seed=None),
                                  images=())
        yielded = []

        async def read():  # as the session does while its writer is paused: a loop turn after each chunk
            async for chunk in replies.stream(worker, request, "r", RequestLog("r", "chat_completions"), sink):
                yielded.append(chunk)
                if sink is not None:
                    sink.sent.append(chunk)
                await asyncio.sleep(0)

        task = asyncio.create_task(read())
        await asyncio.sleep(0)  # the task submits
        for step, step_turns in zip(steps, turns or [10] * len(steps)):
            if task.done():
                break
            worker.deliver(step)
            if sink is not None:
                sink.readiness = sink.readiness[1:]
            for _ in range(step_turns):
                await asyncio.sleep(0)
        await asyncio.wait_for(task, 5)
        return yielded, sink.chunks if sink is not None else [], worker
    return asyncio.run(main())


@pytest.fixture(scope="module")
def replies(smollm2_tokenizer):
    return ChatReplies(smollm2_tokenizer, None)


def test_the_callback_sends_what_the_task_would_yield(smollm2_tokenizer, replies):
    tokens = {"r/0": smollm2_tokenizer.encode("Paris is nice."), "r/1": smollm2_tokenizer.encode("Rome is nice.")}
    assert len(tokens["r/0"]) == len(tokens["r/1"]) > 2
    steps = steps_of(tokens, "length")
    yielded, _, _ = serve(replies, OutputPlan(n=2), steps)
    not_yielded, sent, _ = serve(replies, OutputPlan(n=2), steps, Sink([True] * len(steps)))
    assert not_yielded == [] and sent == yielded
    assert sent[-1]["finish_reason"] == "length" and sent[-1]["usage"]["completion_tokens"] == 2 * len(tokens["r/0"])


def test_a_sink_that_stops_being_ready_leaves_the_rest_to_the_task(smollm2_tokenizer, replies):
    steps = steps_of({"r": smollm2_tokenizer.encode("One two three four five")}, "length")
    yielded, _, _ = serve(replies, OutputPlan(), steps)
    rest, sent, _ = serve(replies, OutputPlan(), steps, Sink([True, True]))
    assert len(sent) == 2 and rest and sent + rest == yielded


def test_the_callback_waits_for_the_task_to_yield_what_it_took(smollm2_tokenizer, replies):
    """A sink ready again while the task has chunks of a step left to yield: the next step's chunks follow them."""
    tokens = {"r/0": smollm2_tokenizer.encode("Paris is nice."), "r/1": smollm2_tokenizer.encode("Rome is nice.")}
    sink = Sink([False, True, True, True])
    serve(replies, OutputPlan(n=2), steps_of(tokens, "length"), sink, turns=[1, 10, 10, 10])
    assert sink.chunks, "the callback sent some"
    assert ["".join(c["content"] for c in sink.sent if c["index"] == i) for i in (0, 1)] == ["Paris is nice.",
                                                                                              "Rome is nice."]
    assert [i for i, chunk in enumerate(sink.sent) if "finish_reason" in chunk] == [len(sink.sent) - 1]


def test_a_stop_string_met_in_the_callback_ends_the_request(smollm2_tokenizer, replies):
    """The engine is never told more than the abort: the task ends on the last chunk the callback sent."""
    ids = smollm2_tokenizer.encode("Paris is nice. Lyon too.")
    steps = steps_of({"r": ids}, "length")[:-1]  # the engine would go on
    _, sent, worker = serve(replies, OutputPlan(), steps, Sink([True] * len(steps)), stop=("nice",))
    assert "".join(chunk["content"] for chunk in sent) == "Paris is "
    assert sent[-1]["finish_reason"] == "stop" and sent[-1]["stop_sequence"] == "nice"
    assert worker.aborted[0] == "r"


def test_an_engine_failure_met_in_the_callback_is_raised_by_the_task(replies):
    failed = [[RequestOutput("r", [], "error", "the device fell over", 3, 0, 0)]]
    with pytest.raises(RuntimeError, match="the engine failed on this request: the device fell over"):
        serve(replies, OutputPlan(), failed, Sink([True]))
