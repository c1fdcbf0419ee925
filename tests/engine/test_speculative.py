"""Speculative decoding: a verification step scores a request's draft tokens with its last token, and the
sampler keeps what the model itself would have produced.

Greedy outputs with drafts equal those without, token for token, on plain, chunked, preempting, overlapped and
grammar-constrained engines, with stop tokens and max_tokens cutting drafts short. Random weights copy little,
so besides the real drafters on prompts that repeat, a drafter proposes the model's own greedy continuation
with one token in two drafts corrupted: many tokens accepted, many rejected. Taking one token too many
(a rejected draft token, or the token after an accepted run) changes the outputs; counting a rejected draft
token as computed breaks the KV cache and leaks blocks. The rejection rule's output distribution is the
model's, by a chi-square test on a tiny vocabulary."""
import asyncio
import inspect
import itertools
import types

import numpy as np
import pytest
import torch
import xgrammar
from test_constraints import SCHEMA, tiny_vocabulary
from test_graph_padding import with_eager_graphs
from test_overlap import cut

from engine import LLM, EngineConfig, SamplingParams, Worker
from engine.config import parse_speculative
from engine.cuda_graphs import CudaGraphs, GraphShape
from engine.drafters import NgramDrafter, SuffixDrafter
from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.speculation import (
    FIRST_STEPS,
    MAX_PROBE_AFTER_STEPS,
    PROBE_AFTER_STEPS,
    Speculator,
    StepPeriods,
    StepTimer,
    batch_class,
    draft_length,
)
from handler.grammar import GrammarConstraint
from handler.logs import speculation_summary
from models import llama
from random_decoders import TINY
from speculative_testing import CorruptedOracle

NEW = 32
VOCAB = TINY["vocab_size"]
CHI_SQUARE_AT_ONE_IN_A_THOUSAND = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # by degrees of freedom


def speculating(llm, drafter=None, overlap=False):
    """Turns speculation on for every step (no back-off) with the given drafter; checks after every step that
    no request holds blocks past its computed tokens and the one it computes next."""
    core = llm.core
    core.overlap = overlap
    core.speculator.adaptive = False
    if drafter is not None:
        core.speculator.drafter = drafter
    step = core.step

    def checked():
        results = step()
        for seq in core.scheduler.running:
            needed = -(-(seq.num_computed_tokens + 1) // core.block_manager.block_size)
            assert len(seq.block_table) <= needed, "blocks of rejected drafts were not given back"
        return results

    core.step = checked
    return llm


def verification_kinds(llm) -> list[bool]:
    """Records, per verification step, whether it was staged as decode rows (one per token) or, mixed with
    prompt chunks, as a prefill step."""
    kinds, verifies_as_rows = [], llm.core.runner.buffers.verifies_as_rows

    def recording(seqs, num_tokens):
        as_rows = verifies_as_rows(seqs, num_tokens)
        if any(seq.draft_token_ids for seq in seqs):
            kinds.append(as_rows)
        return as_rows

    llm.core.runner.buffers.verifies_as_rows = recording
    return kinds


def outputs(llm, prompts, params, constraints=None):
    return [out["token_ids"] for out in llm.generate(prompts, params, constraints=constraints)]


def assert_all_blocks_free(llm):
    stats = llm.core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not stats["running"] and not stats["waiting"]


def staggered(references: list[list[int]]) -> list[SamplingParams]:
    """Greedy requests ending at different tokens: their own output's tokens as stop tokens, or max_tokens."""
    return [SamplingParams(temperature=0, max_tokens=[NEW, 1, 9, NEW][i % 4],
                           stop_token_ids=[reference[6 + 3 * i]] if i % 3 == 1 else [])
            for i, reference in enumerate(references)]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    pieces = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 7, 11, 30, 3, 19)]
    return [piece * (1 + 24 // len(piece)) for piece in pieces]  # repeats, for the real drafters to find


@pytest.fixture(scope="module")
def plain(tiny_llama, prompts):
    llm = LLM(tiny_llama.path, dtype="float32")
    references = outputs(llm, prompts, SamplingParams(temperature=0, max_tokens=NEW))
    params = staggered(references)
    return references, params, outputs(llm, prompts, params)


ENGINES = {"plain": {}, "chunked": {"max_num_batched_tokens": 24}, "preempting": {"num_kv_blocks": 5}}


@pytest.mark.parametrize("engine, overlap", [("plain", False), ("plain", True), ("chunked", True),
                                             ("preempting", False)])
def test_greedy_outputs_with_corrupted_oracle_drafts_equal_those_without(tiny_llama, prompts, plain, engine,
                                                                           overlap):
    references, params, expected = plain
    llm = speculating(LLM(tiny_llama.path, dtype="float32", speculative="ngram:k=5", **ENGINES[engine]),
                      CorruptedOracle(references, VOCAB), overlap)
    kinds = verification_kinds(llm)
    assert outputs(llm, prompts, params) == expected
    assert True in kinds and (False in kinds or engine != "chunked"), "both ways of staging a verification"
    stats = llm.core.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"], "accepted and rejected drafts"
    if engine == "preempting":
        assert llm.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)
    if engine == "plain" and not overlap:
        assert outputs(llm, prompts, params) == expected, "again, the prompts from the prefix cache"
        assert llm.core.block_manager.num_hit_tokens > 0
        assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def long_outputs(tiny_llama, prompts):
    """Long greedy outputs, in which the tiny model repeats itself now and then (n-gram drafts)."""
    params = SamplingParams(temperature=0, max_tokens=2 * NEW)
    return params, outputs(LLM(tiny_llama.path, dtype="float32"), prompts, params)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_outputs_with_each_drafter_equal_those_without(tiny_llama, prompts, long_outputs, method):
    params, expected = long_outputs
    llm = speculating(LLM(tiny_llama.path, dtype="float32", speculative=f"{method}:k=3", max_num_batched_tokens=32))
    assert outputs(llm, prompts, params) == expected
    first = llm.core.stats()
    assert first["spec_drafted_tokens"] > 0
    if method == "suffix":  # it has seen these outputs: the second run's drafts are them
        assert outputs(llm, prompts, params) == expected
        assert llm.core.stats()["spec_accepted_tokens"] - first["spec_accepted_tokens"] > 2 * NEW
    assert_all_blocks_free(llm)


def test_greedy_logprobs_with_drafts_equal_those_without(tiny_llama, prompts, plain):
    references = plain[0]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    expected = LLM(tiny_llama.path, dtype="float32").generate(prompts[:3], params)
    llm = speculating(LLM(tiny_llama.path, dtype="float32", speculative="ngram"), CorruptedOracle(references, VOCAB))
    got = llm.generate(prompts[:3], params)
    assert llm.core.stats()["spec_accepted_tokens"] > 0
    for want, have in zip(expected, got):
        assert have["token_ids"] == want["token_ids"]
        for (logprob, ids, top), (logprob_want, ids_want, top_want) in zip(have["logprobs"], want["logprobs"]):
            assert ids == ids_want
            assert logprob == pytest.approx(logprob_want, abs=1e-4)
            assert top == pytest.approx(top_want, abs=1e-4)


def test_grammar_constrained_greedy_outputs_with_drafts_equal_those_without(tiny_llama, prompts):
    """The grammar judges draft tokens: drafts it rejects are cut, and each verified row is masked by the
    grammar's state after the draft tokens before it. Drafts of the constrained continuation (accepted) and of
    the unconstrained one (mostly outside the grammar) both leave the outputs unchanged."""
    info = xgrammar.TokenizerInfo(tiny_vocabulary(), vocab_size=VOCAB, stop_token_ids=[0])
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    params = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[0])
    plain_llm = LLM(tiny_llama.path, dtype="float32")
    expected = outputs(plain_llm, prompts, params, [GrammarConstraint(grammar) for _ in prompts])
    free = outputs(plain_llm, prompts, SamplingParams(temperature=0, max_tokens=NEW))
    assert expected != free
    for continuations in (expected, free):
        llm = speculating(LLM(tiny_llama.path, dtype="float32", speculative="ngram:k=4"),
                          CorruptedOracle(continuations, VOCAB))
        assert outputs(llm, prompts, params, [GrammarConstraint(grammar) for _ in prompts]) == expected
        assert_all_blocks_free(llm)
        if continuations is expected:
            assert llm.core.stats()["spec_accepted_tokens"] > 0


def rejection_sample(logits: torch.Tensor, draft: int, params: SamplingParams, rows: int) -> np.ndarray:
    """The token each of `rows` identical rows takes under the rejection rule: the draft token where accepted,
    else the row's drawn token."""
    torch.manual_seed(3)  # the acceptance draws
    sampler = Sampler(torch.device("cpu"), seed=3)  # the Gumbel noise
    seqs = [Sequence(0, [1], params, 64)] * rows
    values = sampler.verify(logits.expand(rows, -1).clone(), seqs, np.full(rows, draft, dtype=np.int64))[0]
    drawn, accepted = values[:rows], values[rows:].bool()
    return torch.where(accepted, draft, drawn).numpy()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
@pytest.mark.parametrize("draft", [2, 3])  # the likeliest token; an unlikely one, outside the top k
def test_rejection_sampling_draws_the_models_distribution(params, draft):
    logits = torch.tensor([[1.0, 0.2, 2.0, -0.5, 0.7, 1.5]])
    rows = 20000
    taken = rejection_sample(logits, draft, params, rows)
    sampler = Sampler(torch.device("cpu"))
    plan = sampler.plan_for([Sequence(0, [1], params, 64)])
    kept = logits.masked_fill(Sampler.dropped(logits, plan), float("-inf")) if plan.uses_masks else logits
    target = torch.softmax(kept / params.temperature, dim=-1)[0].numpy()
    counts = np.bincount(taken, minlength=logits.shape[1])
    support = target > 0
    assert counts[~support].sum() == 0, "a token outside top-k/top-p was taken"
    expected = target[support] * rows
    chi_square = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi_square < CHI_SQUARE_AT_ONE_IN_A_THOUSAND[int(support.sum()) - 1]


def test_a_greedy_row_accepts_exactly_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.5], [0.1, 3.0, 0.5]])
    seqs = [Sequence(0, [1], SamplingParams(temperature=0), 64)] * 2
    values = Sampler(torch.device("cpu")).verify(logits, seqs, np.array([1, 2]))[0].tolist()
    assert values == [1, 1, 1, 0]  # drawn: the argmax; accepted: the argmax only


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    seq = Sequence(0, [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 6, 7], SamplingParams(), 64)
    assert NgramDrafter().propose(seq, 3) == [3, 4, 6]
    seq.token_ids += [3]
    assert NgramDrafter().propose(seq, 2) == [4, 6]
    assert NgramDrafter().propose(Sequence(1, [1, 2, 3, 4], SamplingParams(), 64), 3) == []


def test_ngram_drafter_falls_back_to_the_last_token_alone():
    seq = Sequence(0, [5, 6, 7, 8, 6], SamplingParams(), 64)
    assert NgramDrafter().propose(seq, 2) == [7, 8], "no pair matches: the last token does"


def test_ngram_drafter_keeps_copying_from_where_its_last_proposal_copied():
    """The last four tokens occurred latest elsewhere, followed by something else: a copy goes on from its own
    source as long as the tokens since are the source's, and looks up anew once they are not."""
    seq = Sequence(0, [7, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 4, 9, 7, 1], SamplingParams(), 64)
    drafter = NgramDrafter()
    assert drafter.propose(seq, 2) == [2, 3], "7, 1 occurred once"
    seq.token_ids += [2, 3, 4]  # two draft tokens accepted, and the model's own next one: the source's too
    assert drafter.propose(seq, 2) == [5, 6], "the copy goes on (1, 2, 3, 4 occurred latest before 9)"
    seq.token_ids += [5, 1]  # the model left the source
    assert drafter.propose(seq, 2) == [2, 3], "looked up anew: 5, 1 did not occur, 1 latest before 2, 3"


def test_ngram_drafter_matches_whole_tokens_only():
    """A token's bytes can repeat across two tokens; only a match aligned on tokens counts."""
    straddling = [1 << 24, 2 << 24, 0]  # native bytes 00 00 00 01 | 00 00 00 02 | 00 00 00 00
    seq = Sequence(0, [1, 2, 7, *straddling, 9, 1, 2], SamplingParams(), 64)
    assert NgramDrafter().propose(seq, 2) == [7, 1 << 24]


def output_sequence(request_id: int, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(request_id, prompt, SamplingParams(), 64)
    seq.token_ids += output
    return seq


def test_suffix_drafter_follows_the_most_frequent_continuation_across_requests():
    drafter = SuffixDrafter(depth=4)
    drafter.propose(output_sequence(0, [1], [2, 3, 4, 5, 9, 9]), 1)
    drafter.propose(output_sequence(1, [7], [2, 3, 4, 5, 6, 8]), 1)
    drafter.propose(output_sequence(2, [8], [3, 4, 5, 6, 1]), 1)
    assert drafter.propose(Sequence(3, [0, 0, 3, 4], SamplingParams(), 64), 3) == [5, 6, 8]
    assert drafter.propose(output_sequence(4, [3, 4, 5, 6, 1, 3, 4, 5, 2], [3, 4]), 3) == [5, 2, 3], (
        "a request's own tokens come first")
    assert drafter.propose(Sequence(5, [9, 0, 6, 1], SamplingParams(), 64), 2) == [], (
        "the trie holds outputs, not prompts")


def test_suffix_drafter_forgets_the_oldest_outputs_past_its_capacity():
    drafter = SuffixDrafter(depth=2, capacity=3)
    drafter.propose(output_sequence(0, [1], [2, 3, 4]), 1)
    assert drafter.propose(Sequence(1, [0, 2, 3], SamplingParams(), 64), 1) == [4]
    drafter.propose(output_sequence(2, [9], [5, 6, 7]), 1)
    assert drafter.propose(Sequence(3, [0, 2, 3], SamplingParams(), 64), 1) == []
    assert drafter.next_counts == {(9, 5): {6: 1}, (5, 6): {7: 1}}, "only the newest outputs' counts are left"


@pytest.mark.parametrize("raw, parsed", [("off", ("off", 0, None)), ("ngram", ("ngram", 4, None)),
                                         ("suffix:k=7", ("suffix", 7, None)), (" NGRAM:k=2 ", ("ngram", 2, None))])
def test_speculative_setting_parses(raw, parsed):
    assert parse_speculative(raw) == parsed


@pytest.mark.parametrize("raw", ["eagle", "ngram:k=0", "ngram:k=99", "ngram:n=3", "off:k=2", "ngram:k="])
def test_a_bad_speculative_setting_names_the_variable(raw):
    with pytest.raises(ValueError, match="HFENDPOINT_SPECULATIVE.*off, ngram or suffix"):
        EngineConfig.from_env("model", {"HFENDPOINT_SPECULATIVE": raw})


def test_the_worker_streams_every_verified_token_with_its_logprobs(tiny_llama, prompts, plain):
    references = plain[0]
    worker = Worker(EngineConfig(tiny_llama.path, device="cpu", speculative="ngram:k=4"))
    try:
        speculating(worker, CorruptedOracle(references, VOCAB))
        params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=1)

        async def collect(queue):
            items = []
            while not (items and items[-1].finish_reason):
                items.append(await queue.get())
            return items

        async def main():
            queues = [worker.submit(i, prompt, params) for i, prompt in enumerate(prompts[:3])]
            return await asyncio.gather(*(collect(queue) for queue in queues))

        for reference, items in zip(references, asyncio.run(main())):
            tokens = [token for item in items for token in item.new_token_ids]
            assert tokens == reference
            assert [top[0] for item in items for _, top, _ in item.logprobs] == reference
            assert max(len(item.new_token_ids) for item in items) > 1, "a step delivered several tokens"
        assert worker.stats()["spec_accepted_tokens"] > 0
    finally:
        worker.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in graphs count their replays; a GPU's real ones don't")
def test_verification_steps_replay_the_graphs_of_their_padded_shapes(tiny_llama, prompts, plain):
    """On the CPU, stand-in graphs run the forward on the padded buffers a GPU graph replays: verifications
    as decode rows pad to the decode graph of their token count, mixed ones to a prefill graph."""
    references, params, expected = plain
    llm = speculating(LLM(tiny_llama.path, dtype="float32", speculative="ngram:k=5", max_num_seqs=8,
                          max_num_batched_tokens=40), CorruptedOracle(references, VOCAB))
    graphs = with_eager_graphs(llm)
    kinds = verification_kinds(llm)
    assert outputs(llm, prompts, params) == expected
    assert True in kinds
    assert any(graph.replays for shape, graph in graphs.items() if shape.verifies)
    assert_all_blocks_free(llm)
    graphs = CudaGraphs(EngineConfig(model="-", device="cpu", max_num_seqs=32, speculative="ngram"))
    assert [shape.num_tokens for shape in graphs.shapes() if shape.verifies] == [2, 4, 8, 16, 24, 32]
    assert not any(shape.verifies for shape in CudaGraphs(EngineConfig(model="-", device="cpu")).shapes())
    graphs.captured = dict.fromkeys(graphs.shapes())
    assert graphs.shape_for([3, 4], as_rows=True) == GraphShape(8, 8, is_decode=True, verifies=True)
    assert graphs.shape_for([1] * 7) == GraphShape(8, 8, is_decode=True), "a plain step: the fused kernel's graph"
    assert graphs.shape_for([3, 4]) == GraphShape(16, 32, is_decode=False)


def test_the_engine_line_reports_acceptance_only_while_speculating():
    assert speculation_summary({"spec_drafted_tokens": 0, "spec_accepted_tokens": 0}) == ""
    assert speculation_summary({"spec_drafted_tokens": 40, "spec_accepted_tokens": 30}) == (
        ", draft tokens accepted 30/40 (75%)")


def test_back_off_drafts_when_its_tokens_come_faster_and_probes_less_and_less():
    periods = StepPeriods()
    assert periods.drafting_pays(4, 8.0) is True  # a drafting step is measured first
    periods.record(True, 3.0)
    assert periods.drafting_pays(4, 8.0) is False  # then a plain one
    periods.record(False, 1.0)
    assert periods.drafting_pays(4, 10.0) is True, "14 tokens in 3 s beat 4 tokens a second by the margin"
    assert periods.drafting_pays(4, 8.5) is False, "12.5 tokens in 3 s do not beat it by the margin"
    choices = []
    for _ in range(2000):
        choices.append(periods.drafting_pays(4, 7.5))  # 11.5 tokens in 3 s lose
        if choices[-1]:
            periods.drafted(4, 0)
    assert choices.count(True) < 0.02 * len(choices), "plain steps are faster: drafting only on probes"
    probes = [i for i, drafting in enumerate(choices) if drafting]
    gaps = [later - earlier for earlier, later in zip(probes, probes[1:])]
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]
    periods.drafted(4, 10)
    assert [periods.drafting_pays(4, 0.0) for _ in range(16)].count(True) == 1, "a probe that gained: soon again"
    periods.record(True, 1.0)
    assert periods.drafting_pays(4, 7.5) is True, "once drafting steps get cheaper, it runs"


def test_each_kind_of_step_is_timed_over_its_runs_switches_included(monkeypatch):
    """With overlap a plain run after a drafting step pays a double step first and a near-empty one last: a
    run's average holds the cost of its kind; timing steps one by one would call plain steps twice as fast."""
    clock = iter([0.0, 0.08, 0.12, 0.1201, 0.1801, 0.2601, 0.3001])
    monkeypatch.setattr("engine.speculation.time.perf_counter", lambda: next(clock))
    periods, timer = StepPeriods(), StepTimer()
    timer.step(periods, drafting=True, decoding=False)  # a prefill step: nothing to time
    for drafting in (False, False, False, True, False, False):  # ends at 0.08, 0.12, 0.1201, 0.1801, ...
        timer.step(periods, drafting, decoding=True)
    assert periods.seconds[False] == pytest.approx(0.1201 / 3)
    assert periods.seconds[True] == pytest.approx(0.06)
    timer.close()
    assert periods.seconds[False] == pytest.approx(0.7 * 0.1201 / 3 + 0.3 * 0.06)



def test_a_kind_not_yet_timed_is_recorded_after_a_few_steps(monkeypatch):
    """The choice waits for both kinds' times: an unmeasured kind's run is recorded after FIRST_STEPS steps."""
    monkeypatch.setattr("engine.speculation.time.perf_counter", iter(range(100)).__next__)
    periods, timer = StepPeriods(), StepTimer()
    timer.step(periods, drafting=False, decoding=False)
    for _ in range(FIRST_STEPS):
        timer.step(periods, drafting=True, decoding=True)
    assert True not in periods.seconds
    timer.step(periods, drafting=True, decoding=True)
    assert periods.seconds[True] == 1


def test_back_off_drafts_nothing_for_a_full_batch_or_hopeless_drafts():
    speculator = Speculator("ngram", 4, max_rows=4)
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(temperature=0), 64) for i in range(4)]
    for seq in seqs:
        seq.num_computed_tokens = 2
    assert not speculator.decide(seqs), "no row is left for a draft token"
    assert not speculator.decide(seqs[:3]), "most requests would get no row for a draft token"
    assert speculator.decide(seqs[:2])
    assert not speculator.decide([]), "the last requests finished: nothing to draft for"
    for seq in seqs[:2]:
        seq.draft_gain = 0.01
    assert not speculator.decide(seqs[:2]), "drafts that gain almost nothing"


def test_a_request_drafts_as_long_as_its_last_token_stays_likely_to_be_accepted():
    seq = Sequence(0, [1, 2, 3], SamplingParams(temperature=0), 64)
    lengths = []
    for rate in (0.0, 0.3, 0.5, 0.79, 1.0):
        seq.acceptance = rate
        lengths.append(draft_length(seq, 8))
    assert lengths == [1, 1, 3, 8, 8], "0.5^3 and 0.79^8 are over a tenth, 0.5^4 is not"


def test_a_probe_whose_tokens_do_not_pay_for_its_step_makes_probes_rarer():
    """A probe that gains some tokens, but too few for the slower step, must not keep probes frequent: each
    would cost a batch that never profits a step that is not overlapped."""
    periods = StepPeriods()
    periods.record(True, 3.0)
    periods.record(False, 1.0)
    soon = periods.probe_after
    periods.drafted(4, 2)  # 6 tokens in 3 s against 4 a second
    assert periods.probe_after == 2 * soon
    periods.drafted(4, 10)  # 14 tokens in 3 s
    assert periods.probe_after == soon


def test_back_off_weighs_the_request_that_gains_least():
    """Drafts that only part of the batch gains from (answers copying or looping) slow the rest, and the slowest
    request sets when the batch is done: no drafting."""
    speculator = Speculator("ngram", 4, max_rows=64)
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(temperature=0), 64) for i in range(5)]
    for seq, gain in zip(seqs, (6.0, 6.0, 6.0, 6.0, 0.0)):
        seq.num_computed_tokens, seq.draft_gain = 2, gain
    assert not speculator.decide(seqs), "four of five gain many tokens, one none"
    seqs[4].draft_gain = 1.0
    assert speculator.decide(seqs), "all five gain: a drafting step is timed first"


def test_a_batch_keeps_its_class_while_it_drains_from_a_power_of_two():
    """A batch of 16 or 64 that loses a request must not move to a class measured at other sizes (or not at
    all, which starts the measuring over): classes are centred on powers of two."""
    sizes = (1, 2, 3, 11, 12, 16, 22, 23, 45, 46, 64, 90, 91)
    assert [batch_class(n) for n in sizes] == [0, 1, 2, 3, 4, 4, 4, 5, 5, 6, 6, 6, 7]
    speculator = Speculator("ngram", 4, max_rows=256)
    assert speculator._periods(16) is speculator._periods(13) is not speculator._periods(11)


def attention_by_step(llm, monkeypatch) -> list[tuple[bool, set[bool]]]:
    """Records, per step the runner launches, whether it verifies drafts and the rows_read_each_other its decode
    attention ran with (True: every key stored first; False: each row's own, within the fused kernel's launch)."""
    steps, runner, attention = [], llm.core.runner, llama.qkv_paged_attention
    launch = runner.launch

    def recording_launch(seqs, num_tokens, *args, **kwargs):
        steps.append((any(seq.draft_token_ids for seq in seqs), set()))
        return launch(seqs, num_tokens, *args, **kwargs)

    def recording_attention(*args, **kwargs):
        meta = inspect.signature(attention).bind(*args, **kwargs).arguments["meta"]
        if meta.is_decode:
            steps[-1][1].add(meta.rows_read_each_other)
        return attention(*args, **kwargs)

    monkeypatch.setattr(runner, "launch", recording_launch)
    monkeypatch.setattr(llama, "qkv_paged_attention", recording_attention)
    return steps


@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="the stand-in graphs run the forward in Python; a GPU's real ones don't"))])
def test_only_verification_steps_store_their_keys_before_attention(tiny_llama, prompts, plain, monkeypatch, graphs):
    """A verification step's rows read keys its other rows store in the same step: its attention stores them
    all first, eagerly or in a verification graph. The plain decode steps of the same engine keep the fused
    kernel's way (and its graphs), as an engine without speculation does."""
    references, params, expected = plain
    llm = speculating(LLM(tiny_llama.path, dtype="float32", speculative="ngram:k=3", max_num_seqs=8,
                          max_num_batched_tokens=40, enforce_eager=not graphs), CorruptedOracle(references, VOCAB))
    turns = itertools.cycle([True, False])
    llm.core.speculator.decide = lambda running: next(turns)  # drafting and plain steps take turns
    stand_ins = with_eager_graphs(llm) if graphs else {}
    steps = attention_by_step(llm, monkeypatch)
    assert outputs(llm, prompts, params) == expected
    decode_steps = [(verifies, paths) for verifies, paths in steps if paths]
    assert {verifies for verifies, _ in decode_steps} == {True, False}, "both kinds of decode step ran"
    assert all(paths == {verifies} for verifies, paths in decode_steps)
    replayed = {shape.verifies for shape, graph in stand_ins.items() if shape.is_decode and graph.replays}
    assert replayed == ({True, False} if graphs else set()), "both kinds replayed their own graphs"


def test_a_sliding_window_model_verifies_drafts_and_frees_blocks_behind_its_window(tiny_mistral, prompts):
    """Rows of a verification read only their own window; blocks behind the window of the first token left
    to compute are freed after the rollback, never one a later row still reads."""
    params = SamplingParams(temperature=0, max_tokens=NEW)
    expected = outputs(LLM(tiny_mistral.path, dtype="float32"), prompts, params)
    llm = speculating(LLM(tiny_mistral.path, dtype="float32", speculative="ngram:k=6"),
                      CorruptedOracle(expected, VOCAB))
    assert outputs(llm, prompts, params) == expected
    assert llm.core.stats()["spec_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


def test_a_plain_step_counts_a_draft_on_the_side_once_its_tokens_are_decoded():
    """While no step drafts, a request's draft gain follows what its drafts would have gained: a draft proposed
    on the side counts as verified when the tokens it guessed are decoded, up to the first one guessed wrong."""
    speculator = Speculator("ngram", 4, max_rows=8)
    seq = Sequence(0, [5, 6, 7, 8, 9, 5, 6], SamplingParams(temperature=0), 64)
    seq.num_computed_tokens, seq.draft_gain, seq.acceptance = len(seq.token_ids), 0.0, 1.0
    periods = speculator._periods(1)
    periods.record(True, 1.3)
    periods.record(False, 1.0)
    assert not speculator.decide([seq]), "no gain measured yet"
    speculator.check_aside([seq])
    assert seq.aside_draft == (7, [7, 8, 9, 5])
    for token in (7, 8, 9):
        seq.token_ids.append(token)
        seq.num_computed_tokens += 1
        speculator.check_aside([seq])
        assert seq.draft_gain == 0.0, "the guess holds so far: not counted yet"
    seq.token_ids.append(1)
    speculator.check_aside([seq])
    assert seq.draft_gain == pytest.approx(0.7 * 0.3 * 3), "three of four guessed tokens decoded; then a miss"
    assert seq.aside_draft is None, "nothing follows 9, 1 earlier: the next draft found nothing"
    assert speculator.decide([seq]), "1.63 tokens a drafting step beat one a plain step by the margin"
    assert speculator.stats()["spec_drafted_tokens"] == 0, "drafts on the side are not drafts verified"


def test_a_draft_on_the_side_guessed_wrong_at_once_counts_nothing():
    speculator = Speculator("ngram", 4, max_rows=8)
    seq = Sequence(0, [5, 6, 7, 8, 9, 5, 6], SamplingParams(temperature=0), 64)
    seq.num_computed_tokens, seq.draft_gain, seq.acceptance = len(seq.token_ids), 1.0, 1.0
    speculator.check_aside([seq])
    seq.token_ids.append(2)
    speculator.check_aside([seq])
    assert seq.acceptance == pytest.approx(0.7), "none of four accepted"
    assert seq.draft_gain == pytest.approx(0.7 * 0.7), "none accepted, then nothing found after 6, 2"


def test_plain_steps_of_a_speculative_engine_check_drafts_on_the_side(tiny_llama, prompts, long_outputs,
                                                                       monkeypatch):
    """With drafting never paying, every step is plain: the drafts checked on the side move the gains, and
    greedy outputs stay those without speculation."""
    params, expected = long_outputs
    monkeypatch.setattr(StepPeriods, "drafting_pays", lambda self, num_running, gain: False)
    counted = []
    monkeypatch.setattr("engine.speculation.count_verification", lambda seq, drafted, accepted: counted.append(
        (drafted, accepted)))
    llm = LLM(tiny_llama.path, dtype="float32", speculative="ngram:k=3")
    assert outputs(llm, prompts, params) == expected
    assert llm.core.stats()["spec_drafted_tokens"] == 0
    assert counted and all(0 <= accepted <= drafted <= 3 for drafted, accepted in counted)
    assert_all_blocks_free(llm)


def test_time_the_engine_idles_between_requests_is_no_steps_time(tiny_llama, prompts, monkeypatch):
    """A server's engine steps while it has requests (the Worker), so a step launched ahead for a request that
    finished is returned by the next request's first step() call: the idle time before it must not count as the
    seconds of a plain step. Each request ends on a stop token, which the scheduler cannot foresee, so a step is
    launched ahead of its last one (one that ends by its length launches none)."""
    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    llm = LLM(tiny_llama.path, dtype="float32", speculative="ngram:k=3")
    llm.core.overlap = True
    greedy = outputs(llm, prompts[:3], SamplingParams(temperature=0, max_tokens=NEW))
    llm.core.speculator.periods.clear()  # the runs above were timed by the real clock
    llm.core.speculator.timer = StepTimer()
    monkeypatch.setattr("engine.speculation.time.perf_counter", tick)
    for i, (prompt, output) in enumerate(zip(prompts[:3], greedy)):
        params = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[output[NEW // 2]])
        seq = llm.core.make_sequence(i, prompt, params)
        llm.core.add(seq)
        while llm.core.has_work():  # as the Worker steps
            llm.core.step()
        assert len(seq.output_token_ids) < NEW and llm.core.in_flight is not None
        clock[0] += 1e6  # idle
    seconds = [s for periods in llm.core.speculator.periods.values() for s in periods.seconds.values()]
    assert seconds and max(seconds) < 10


def test_a_step_far_slower_than_the_others_of_its_kind_is_not_timed(monkeypatch):
    """The first drafting step may compile kernels or capture graphs: neither it, nor a later probe that is as
    slow, enters the class's drafting time, while its run's usual steps do."""
    clock = iter(itertools.accumulate([0.0, 0.3, 0.002, 0.002, 0.002, 0.001, 0.001, 0.5, 0.001]))
    monkeypatch.setattr("engine.speculation.time.perf_counter", clock.__next__)
    periods, timer = StepPeriods(), StepTimer()
    timer.step(periods, drafting=True, decoding=False)  # a prefill step
    for drafting in (True,) * FIRST_STEPS + (False, False):  # the first drafting step takes 0.3 s
        timer.step(periods, drafting, decoding=True)
    assert periods.seconds[True] == pytest.approx(0.002)
    timer.step(periods, drafting=True, decoding=True)  # a probe after the plain run: 0.5 s
    timer.step(periods, drafting=False, decoding=True)
    assert periods.seconds == pytest.approx({True: 0.002, False: 0.001})


def fresh_decoding(n: int, draft_gain: float = 8.0) -> list[Sequence]:
    seqs = [Sequence(i, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], SamplingParams(temperature=0), 64) for i in range(n)]
    for seq in seqs:
        seq.num_computed_tokens, seq.acceptance, seq.draft_gain = len(seq.token_ids) - 1, 1.0, draft_gain
    return seqs


def test_a_step_short_of_rows_shares_them_equally_among_its_drafts():
    """Rows left to a few requests leave the others without a draft: they gain nothing, and the request that
    gains least sets when the batch is done."""
    speculator = Speculator("ngram", 8, max_rows=12)
    seqs = fresh_decoding(4)
    speculator.propose(seqs)
    assert [len(seq.draft_token_ids) for seq in seqs] == [2, 2, 2, 2]
    speculator = Speculator("ngram", 8, max_rows=7)
    speculator.propose(seqs)
    assert [len(seq.draft_token_ids) for seq in seqs] == [1, 1, 1, 0], "short of rows: the oldest first"


def test_back_off_expects_no_request_to_gain_more_than_its_share_of_the_rows():
    """Requests that gained 8 tokens a drafting step when they had the rows gain 3 at most where 64 share the
    192 rows left: that does not pay for a step 4 times slower, and not even a probe could."""
    speculator = Speculator("ngram", 8, max_rows=256)
    periods = speculator._periods(64)
    periods.record(True, 4.0)
    periods.record(False, 1.0)
    assert speculator.draft_share(64) == 3 and not speculator.could_pay(64)
    assert not any(speculator.decide(fresh_decoding(64)) for _ in range(PROBE_AFTER_STEPS + 1))
    assert periods.probe_after == MAX_PROBE_AFTER_STEPS
    periods.record(True, 1.5)
    periods.record(True, 1.5)
    assert speculator.could_pay(64) and speculator.decide(fresh_decoding(64)), "a cheaper drafting step pays"


def test_a_step_with_prompt_tokens_to_compute_does_not_draft():
    """A request whose prompt the next step still computes gains nothing from drafts, and a drafting step would
    cost the batch its overlap; once the step in flight finishes the prompt, the next one may draft."""
    speculator = Speculator("ngram", 4, max_rows=8)
    seqs = fresh_decoding(2)
    seqs[1].num_computed_tokens = 4  # 6 prompt tokens to compute
    assert not speculator.decide(seqs)
    chunk = types.SimpleNamespace(seqs=seqs, num_tokens=[1, 4])
    assert not speculator.decide(seqs, chunk), "a chunk in flight that leaves two prompt tokens"
    chunk.num_tokens = [1, 5]
    assert speculator.decide(seqs, chunk), "the step in flight leaves the prompt's last token: the next decodes it"


def test_plain_steps_check_no_drafts_on_the_side_where_drafting_cannot_pay(tiny_llama, prompts, long_outputs,
                                                                           monkeypatch):
    """Where drafting steps cost far more than a whole draft could gain, drafts checked on the side are host
    work for nothing."""
    params, expected = long_outputs
    llm = LLM(tiny_llama.path, dtype="float32", speculative="ngram:k=3")
    for b in range(4):  # every class a batch of these prompts has
        llm.core.speculator._periods(1 << b).seconds = {True: 100.0, False: 1.0}
    checked = []
    monkeypatch.setattr(Speculator, "check_aside", lambda self, seqs: checked.append(len(seqs)))
    assert outputs(llm, prompts, params) == expected
    assert not checked and llm.core.stats()["spec_drafted_tokens"] == 0
    assert_all_blocks_free(llm)


def first_launches(llm) -> list[bool]:
    """Records, per generate call, whether its first launch went on from a step in flight (ahead)."""
    firsts, launch, generate = [], llm.core.runner.launch, llm.generate

    def recording_launch(seqs, num_tokens, ahead=None, follows=()):
        if len(firsts) < calls[0]:
            firsts.append(ahead is not None)
        return launch(seqs, num_tokens, ahead, follows)

    def counting_generate(*args, **kwargs):
        calls[0] += 1
        return generate(*args, **kwargs)

    calls = [0]
    llm.core.runner.launch, llm.generate = recording_launch, counting_generate
    return firsts


@pytest.mark.parametrize("speculative", ["off", "ngram:k=3"])
def test_a_generate_call_leaves_no_step_in_flight_so_each_starts_alike(tiny_llama, prompts, plain, speculative):
    """Requests that end on a stop token leave a step launched ahead of the one that stopped them; the call that
    ran them finishes it. So every call starts from an idle engine, with speculation on or off, and the next
    call's prompts are launched by its own first step, not ahead of a step of the last call's requests."""
    references, _, _ = plain
    params = [SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[reference[5]])
              for reference in references[:2]]
    llm = LLM(tiny_llama.path, dtype="float32", speculative=speculative)
    llm.core.overlap = True
    firsts = first_launches(llm)
    for _ in range(3):
        assert outputs(llm, prompts[:2], params) == [cut(ref, p) for ref, p in zip(references, params)]
    assert firsts == [False, False, False]
    assert_all_blocks_free(llm)


def test_a_prompt_step_after_the_engine_idled_is_not_a_drafting_step(tiny_llama, prompts, monkeypatch):
    """A step that finishes a prompt may decide that the next step drafts; when its requests all finish in it
    (max_tokens 1), nothing is left to draft for, and the next request's prompt step must be neither drafted
    for nor measured as a drafting step (which would make the speculator probe less at its batch size)."""
    measured = []
    step_done = Speculator.step_done
    monkeypatch.setattr(Speculator, "step_done", lambda self, num_running, drafting, decoding, gained: (
        measured.append(drafting), step_done(self, num_running, drafting, decoding, gained)))
    llm = LLM(tiny_llama.path, dtype="float32", speculative="ngram:k=3")
    llm.core.overlap = True
    for prompt in prompts[:3]:
        measured.clear()
        outputs(llm, [prompt], SamplingParams(temperature=0, max_tokens=1))
        assert measured == [False], "a prompt step is measured as a drafting step"
    assert all(p.probe_after == PROBE_AFTER_STEPS for p in llm.core.speculator.periods.values())
