"""What a start decides and says: the context length (HFENDPOINT_MAX_MODEL_LEN, by default the model's maximum,
capped by what the KV pool holds for one request) and the start-up lines that say where the seconds went."""
import logging
import time

import pytest
from transformers import LlamaConfig

from engine import LLM, EngineConfig, SamplingParams
from random_decoders import TINY, save_random_decoder

MODEL_MAX = 5000  # longer than the 4,096 tokens that used to be every model's default
POOL_GB = 0.01  # the CPU KV pool: room for about 20,000 tokens of the tiny model


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("long")
    save_random_decoder(LlamaConfig(**{**TINY, "max_position_embeddings": MODEL_MAX}), path)
    return str(path)


@pytest.fixture
def startup_lines(caplog):
    caplog.set_level(logging.INFO, logger="engine.startup")
    return lambda: [record.getMessage() for record in caplog.records if record.name == "engine.startup"]


def test_context_defaults_to_the_models_maximum(long_model, startup_lines):
    llm = LLM(long_model, device="cpu", cpu_kv_cache_gb=POOL_GB)
    assert EngineConfig("/m").max_model_len is None
    assert llm.core.max_model_len == MODEL_MAX
    assert f"max_model_len {MODEL_MAX}, set by the model's maximum (max_position_embeddings)," in "\n".join(
        startup_lines())
    out = llm.generate([[1] * (MODEL_MAX - 1)], SamplingParams(max_tokens=1, temperature=0))
    assert len(out[0]["token_ids"]) == 1
    with pytest.raises(ValueError, match=f"max_model_len={MODEL_MAX}"):
        llm.generate([[1] * MODEL_MAX], SamplingParams(max_tokens=1))


def test_a_small_pool_caps_the_context(long_model, startup_lines):
    llm = LLM(long_model, device="cpu", num_kv_blocks=5, block_size=16)
    assert llm.core.max_model_len == 5 * 16 < MODEL_MAX
    assert "max_model_len 80, set by what the KV pool holds for one request," in "\n".join(startup_lines())


@pytest.mark.parametrize("asked, expected, bound", [
    (100, 100, "HFENDPOINT_MAX_MODEL_LEN"),
    (MODEL_MAX + 1, MODEL_MAX, "the model's maximum (max_position_embeddings)"),
])
def test_a_set_context_is_capped_by_the_model(long_model, startup_lines, asked, expected, bound):
    config = EngineConfig.from_env(long_model, {"HFENDPOINT_MAX_MODEL_LEN": str(asked)})
    llm = LLM(long_model, device="cpu", cpu_kv_cache_gb=POOL_GB, max_model_len=config.max_model_len)
    assert llm.core.max_model_len == expected
    assert f"max_model_len {expected}, set by {bound}," in "\n".join(startup_lines())


def test_startup_lines_say_where_the_seconds_went(tiny_llama, startup_lines):
    LLM(tiny_llama.path, device="cpu")
    lines = startup_lines()
    for phase in ("weights", "KV pool", "tokenizer"):
        assert any(line.startswith(phase) and " took " in line and ", at " in line for line in lines), (phase, lines)
    assert lines[0].startswith("engine starting at ") and lines[-1].startswith("engine ready at ")


@pytest.fixture
def pretend_graphs(monkeypatch):
    """Makes an engine's runner plan CUDA graphs as on the GPU, each capture only recorded in `events` (a CPU
    engine captures none), and records every step it launches: ("capture", shape) or ("step", pure decode)."""
    def install(llm) -> list:
        events, runner = [], llm.core.runner
        launch = runner.launch

        def capture_next(model, prepare, hidden_size):
            events.append(("capture", runner.graphs.pending.pop(0)))

        def recorded_launch(seqs, num_tokens, *args):
            events.append(("step", sum(num_tokens) == len(num_tokens)))
            return launch(seqs, num_tokens, *args)

        monkeypatch.setattr(runner.graphs, "capture_next", capture_next)
        monkeypatch.setattr(runner, "launch", recorded_launch)
        runner.graphs.plan_all()
        return events
    return install


def test_graphs_are_captured_before_the_first_decode_step_not_at_start(tiny_llama, pretend_graphs):
    """The first token comes from an eager prefill; every graph is captured before the first pure-decode step,
    with nothing in flight; the steps after it overlap again."""
    llm = LLM(tiny_llama.path, device="cpu")
    events = pretend_graphs(llm)
    num_graphs = len(llm.core.runner.graphs.pending)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
    assert out[0]["token_ids"] == tiny_llama.greedy([1, 2, 3], 4)
    assert events[0] == ("step", False)  # the prefill, before any capture
    assert [kind for kind, _ in events[1:1 + num_graphs]] == ["capture"] * num_graphs
    decodes = events[1 + num_graphs:]  # three tokens, and a step launched ahead whose token is thrown away
    assert set(decodes) == {("step", True)} and len(decodes) >= 3
    assert not llm.core.warming_up


def test_an_idle_worker_warms_up_one_part_at_a_time(tiny_llama, pretend_graphs):
    """A served engine captures while it has nothing to do, without waiting for a request."""
    from engine import Worker

    worker = Worker(EngineConfig(tiny_llama.path, device="cpu"))
    try:
        with worker._cond:  # the engine thread is asleep: plan graphs as a GPU engine has them, then wake it
            events = pretend_graphs(worker)
            num_graphs = len(worker.core.runner.graphs.pending)
            worker._cond.notify()
        deadline = time.monotonic() + 30
        while worker.core.warming_up and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [kind for kind, _ in events] == ["capture"] * num_graphs
    finally:
        worker.shutdown()
