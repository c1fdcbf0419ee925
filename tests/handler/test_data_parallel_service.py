"""`python -m handler` with two data-parallel engines (HFENDPOINT_DATA_PARALLEL_SIZE=2) serving SmolLM2 on CPU
behind our front: concurrent requests, plain and structured, answered as the one-engine handler answers them, and
each engine's stats."""
import asyncio
import json
import sys

import openai
import pytest
from conftest import HostedFrontServer

pytestmark = pytest.mark.slow  # two SmolLM2 engines behind a handler

PROMPTS = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish.", "What is 2 + 2?",
           "Count from one to five.", "What color is the sky?"]


@pytest.fixture(scope="module")
def two_engine_service(smollm2_path):
    env = {"MODEL_ID": smollm2_path, "HFENDPOINT_DEVICE": "cpu", "HFENDPOINT_MAX_MODEL_LEN": "512",
           "HFENDPOINT_REPOSITORY_DIR": "/nonexistent", "HF_HUB_OFFLINE": "1", "HFENDPOINT_MODEL_NAME": "smollm2-dp",
           "HFENDPOINT_DATA_PARALLEL_SIZE": "2"}
    daemon = HostedFrontServer([sys.executable, "-m", "handler"], env)
    daemon.call("models")
    yield daemon
    assert daemon.stop() == 0


async def answers(url: str, prompts: list[str], max_tokens: int = 12, **kwargs) -> list[str]:
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as client:
        replies = await asyncio.gather(*(client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": p}], temperature=0, max_tokens=max_tokens, **kwargs)
            for p in prompts))
    return [reply.choices[0].message.content for reply in replies]


def test_two_engines_answer_concurrent_requests_as_one_engine_does(two_engine_service, smollm2_service):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
    expected = asyncio.run(answers(smollm2_service.url, PROMPTS))
    assert asyncio.run(answers(two_engine_service.url, prompts)) == [expected[i % len(PROMPTS)]
                                                                     for i in range(len(prompts))]
    stats = two_engine_service.call("stats")
    assert len(stats["engines"]) == 2
    assert stats["num_total_blocks"] == sum(engine["num_total_blocks"] for engine in stats["engines"]) > 0


def test_structured_outputs_under_data_parallelism_answer_as_one_engine_does(two_engine_service, smollm2_service):
    """Constrained requests on both engines (the tokenizer info goes to each engine's process with its first one)
    answer as the one-engine handler does."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    prompts = ["Which city is the capital of France? Answer in JSON.", "Name a big city in Japan. Answer in JSON.",
               "Which city is the capital of Italy? Answer in JSON.", "Name a city in Spain. Answer in JSON."]
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    expected = asyncio.run(answers(smollm2_service.url, prompts, max_tokens=40, response_format=response_format))
    texts = asyncio.run(answers(two_engine_service.url, prompts, max_tokens=40, response_format=response_format))
    assert texts == expected
    assert all(set(json.loads(text)) == {"city"} for text in texts)
