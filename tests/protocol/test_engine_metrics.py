"""The front's /metrics with data-parallel engines: each engine's gauges under an `engine` label, beside the
handler's totals."""
from prometheus_client.parser import text_string_to_metric_families

from front.metrics import ServingMetrics


def samples(stats: dict) -> dict:
    text = ServingMetrics(lambda: stats, lambda: True).text().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_each_engine_has_its_own_gauges():
    engines = [{"running": 3, "waiting": 0, "num_free_blocks": 10, "num_total_blocks": 50,
                "prefix_cache_hit_rate": 0.5},
               {"running": 1, "waiting": 2, "num_free_blocks": 40, "num_total_blocks": 50,
                "prefix_cache_hit_rate": 0.1}]
    found = samples({"running": 4, "waiting": 2, "num_free_blocks": 50, "num_total_blocks": 100,
                     "prefix_cache_hit_rate": 0.3, "num_preemptions": 0, "engines": engines})
    assert found[("nanovllm_num_requests_running", ())] == 4
    for index, engine in enumerate(engines):
        label = (("engine", str(index)),)
        assert found[("nanovllm_engine_num_requests_running", label)] == engine["running"]
        assert found[("nanovllm_engine_num_requests_waiting", label)] == engine["waiting"]
        assert found[("nanovllm_engine_kv_cache_blocks_total", label)] == engine["num_total_blocks"]
        assert found[("nanovllm_engine_prefix_cache_hit_rate", label)] == engine["prefix_cache_hit_rate"]


def test_one_engine_has_no_per_engine_gauges():
    found = samples({"running": 1, "waiting": 0, "num_free_blocks": 5, "num_total_blocks": 10})
    assert not any(name.startswith("nanovllm_engine_") for name, _ in found)


def test_speculative_decoding_counts_draft_tokens_verified_and_accepted():
    engines = [{"spec_drafted_tokens": 40, "spec_accepted_tokens": 30}, {"spec_drafted_tokens": 0,
                                                                         "spec_accepted_tokens": 0}]
    found = samples({"running": 0, "spec_drafted_tokens": 40, "spec_accepted_tokens": 30, "engines": engines})
    assert found[("nanovllm_spec_draft_tokens_total", ())] == 40
    assert found[("nanovllm_spec_accepted_tokens_total", ())] == 30
    for index, engine in enumerate(engines):
        label = (("engine", str(index)),)
        assert found[("nanovllm_engine_spec_draft_tokens_total", label)] == engine["spec_drafted_tokens"]
        assert found[("nanovllm_engine_spec_accepted_tokens_total", label)] == engine["spec_accepted_tokens"]
