"""all-MiniLM-L6-v2 served by `python -m handler` behind our front, called by the real openai client."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from model_packages import minilm_dir_or_skip
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow  # the handler and front serving MiniLM

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors; " * 3]


@pytest.fixture(scope="module")
def minilm_path() -> str:
    return minilm_dir_or_skip()


@pytest.fixture(scope="module")
def client(minilm_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("minilm") / "front_server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HFENDPOINT_")}
    env.update(MODEL_ID=minilm_path, HFENDPOINT_DEVICE="cpu", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "front", "--host", "127.0.0.1", "--port", "0",
               "--", sys.executable, "-m", "handler"]
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(command, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"listening on (http://127\.0\.0\.1:\d+)", log_path.read_text())):
            assert daemon.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        with openai.OpenAI(base_url=match.group(1) + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)


def token_count(minilm_path: str, text: str) -> int:
    return len(AutoTokenizer.from_pretrained(minilm_path)(text)["input_ids"])


def test_one_string_and_a_list_give_384_dimensional_unit_vectors_with_usage(client, minilm_path):
    from sentence_transformers import SentenceTransformer

    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[0])
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    assert one.usage.prompt_tokens == one.usage.total_tokens == token_count(minilm_path, TEXTS[0])

    many = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    vectors = np.array([item.embedding for item in sorted(many.data, key=lambda item: item.index)])
    assert vectors.shape == (2, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert many.usage.prompt_tokens == sum(token_count(minilm_path, text) for text in TEXTS)
    assert np.allclose(vectors[0], one.data[0].embedding, atol=1e-6), "the same text gives the same vector"
    expected = SentenceTransformer(minilm_path, device="cpu").encode(TEXTS, normalize_embeddings=True)
    assert (vectors * expected).sum(axis=1).min() > 0.9999


def test_an_input_past_the_limit_is_a_400_unless_truncation_is_asked_for(client, minilm_path):
    long_text = "many words " * 200
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model="all-MiniLM-L6-v2", input=["short", long_text])
    assert raised.value.param == "input" and raised.value.code == "context_length_exceeded"
    assert "input[1] is 402 tokens, more than the model's maximum of 256" in raised.value.message

    cut = client.embeddings.create(model="all-MiniLM-L6-v2", input=[long_text],
                                   extra_body={"truncate_prompt_tokens": 16})
    assert cut.usage.prompt_tokens == 16
    ids = AutoTokenizer.from_pretrained(minilm_path)(long_text)["input_ids"]
    same = client.embeddings.create(model="all-MiniLM-L6-v2", input=[ids[:1] + ids[-15:]])
    assert np.allclose(cut.data[0].embedding, same.data[0].embedding, atol=1e-6), "[CLS] and the last 15 tokens"
    whole = client.embeddings.create(model="all-MiniLM-L6-v2", input=[ids], extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 256
