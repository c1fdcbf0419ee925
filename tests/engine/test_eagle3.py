"""EAGLE-3 draft heads: a tiny random head saved in the published layout drafts for a tiny random target.

Greedy outputs with the head's drafts equal those without, token for token, on plain, chunked, preempting and
grammar-constrained engines, and every KV block comes back; sampled requests with its drafts too. The drafts
the engine proposes equal those of a reference written here from the published description (the target's
residual stream entering the listed layers, concatenated in that order and fused by fc; the head's step at
position p reading the token at p + 1; concat(embedding normed, hidden normed); the layer's output feeding the
next step), recomputed from the whole sequence at every proposal with no cache; the same reference with a wrong
layer, the halves of the concat swapped or the tokens not shifted proposes other tokens. A head that does not
fit the target is refused at start."""
import json
import re

import pytest
import torch
import torch.nn.functional as F
import xgrammar
from safetensors.torch import save_file
from test_constraints import SCHEMA, tiny_vocabulary
from test_speculative import assert_all_blocks_free, outputs, speculating
from transformers import LlamaConfig

from engine import LLM, EngineConfig, SamplingParams
from engine.config import parse_speculative
from handler.grammar import GrammarConstraint
from random_decoders import TINY, save_random_decoder

TARGET = dict(TINY, num_hidden_layers=4)
AUX_LAYERS = [0, 2, 3]  # the embeddings among them: the stream entering layer 0
HEAD = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
            draft_vocab_size=200, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
NEW = 16
ENGINES = {"plain": {}, "chunked": {"max_num_batched_tokens": 16}, "preempting": {"num_kv_blocks": 6}}


def head_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published names; norms away from one, a draft vocabulary that is a random
    subset of the target's (d2t its offsets)."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, d = config["hidden_size"], config["intermediate_size"], config["hidden_size"] // 4
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    tensors = {"fc.weight": rand(hidden, 3 * TARGET["hidden_size"], scale=0.1),
               "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * hidden),
               "midlayer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * hidden),
               "midlayer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * hidden),
               "midlayer.self_attn.o_proj.weight": rand(hidden, heads * d),
               "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
               "midlayer.mlp.up_proj.weight": rand(inter, hidden),
               "midlayer.mlp.down_proj.weight": rand(hidden, inter),
               "lm_head.weight": rand(config["draft_vocab_size"], hidden, scale=1.0)}
    for norm in ("midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = 1 + rand(hidden, scale=0.5)
    targets = torch.randperm(config["vocab_size"], generator=g)[:config["draft_vocab_size"]].sort().values
    tensors["d2t"] = targets - torch.arange(config["draft_vocab_size"])
    tensors["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool).index_fill(0, targets, True)
    return tensors


def save_head(path, config: dict = HEAD, aux_layers=AUX_LAYERS) -> dict[str, torch.Tensor]:
    tensors = head_tensors(config)
    save_file(tensors, str(path / "model.safetensors"))
    saved = LlamaConfig(**config).to_dict() | {"architectures": ["LlamaForCausalLMEagle3"],
                                               "draft_vocab_size": config["draft_vocab_size"]}
    if aux_layers is not None:
        saved["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(saved))
    return tensors


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3-target")
    model = save_random_decoder(LlamaConfig(**TARGET, tie_word_embeddings=False), path, random_biases_and_norms=False)
    return str(path), model


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3-head")
    return str(path), save_head(path)


@pytest.fixture(scope="module")
def prompts(prompts_of_lengths):
    return prompts_of_lengths((5, 17, 33, 2), seed=3)


@pytest.fixture(scope="module")
def expected(target, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW)
    return params, outputs(LLM(target[0], dtype="float32"), prompts, params)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_greedy_outputs_with_eagle3_drafts_equal_those_without(target, head, prompts, expected, engine):
    params, reference = expected
    llm = speculating(LLM(target[0], dtype="float32", speculative=f"eagle3:{head[0]},k=3", **ENGINES[engine]))
    assert outputs(llm, prompts, params) == reference
    assert llm.core.stats()["spec_drafted_tokens"] > 0
    if engine == "preempting":
        assert llm.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)
    if engine == "plain":
        assert outputs(llm, prompts, params) == reference, "again, the prompts' states from the prefix cache"
        assert_all_blocks_free(llm)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = HEAD["rms_norm_eps"]) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, theta: float = HEAD["rope_theta"]) -> torch.Tensor:
    """NeoX rotary of x [T, heads, D] at positions 0..T-1."""
    half = x.shape[-1] // 2
    angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * theta ** (-torch.arange(half) / half)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_layer(w: dict, embeds: torch.Tensor, hidden: torch.Tensor, swap_concat: bool) -> torch.Tensor:
    """The head's decoder layer over a whole sequence, causal, from the published description."""
    parts = [rms(embeds, w["midlayer.input_layernorm.weight"]), rms(hidden, w["midlayer.hidden_norm.weight"])]
    x = torch.cat(parts[::-1] if swap_concat else parts, dim=-1)
    n, heads, kv_heads = len(x), HEAD["num_attention_heads"], HEAD["num_key_value_heads"]
    q = rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, -1))
    k = rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, -1))
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, -1)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attention = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    x = attention @ w["midlayer.self_attn.o_proj.weight"].T + hidden
    h = rms(x, w["midlayer.post_attention_layernorm.weight"])
    return x + (F.silu(h @ w["midlayer.mlp.gate_proj.weight"].T) * (h @ w["midlayer.mlp.up_proj.weight"].T)
                ) @ w["midlayer.mlp.down_proj.weight"].T


@torch.no_grad()
def reference_drafts(model, w: dict, tokens: list[int], k: int, layers=AUX_LAYERS, swap_concat=False,
                     shift=1) -> list[int]:
    """k drafts after tokens (all computed by the target but the last), recomputing the head over the whole
    sequence at each draft."""
    states = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states  # [j]: entering layer j
    hidden = torch.cat([states[j][0] for j in layers], dim=-1) @ w["fc.weight"].T
    embedding = model.model.embed_tokens.weight
    inputs = embedding[torch.tensor(tokens[shift:len(tokens) - 1 + shift])]
    drafts = []
    for _ in range(k):
        out = reference_layer(w, inputs, hidden, swap_concat)[-1]
        draft = int((rms(out, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        drafts.append(draft + int(w["d2t"][draft]))
        hidden = torch.cat((hidden, out[None]))
        inputs = torch.cat((inputs, embedding[drafts[-1]][None]))
    return drafts


@pytest.fixture(scope="module", params=["chunked", "preempting"])
def proposals(request, target, head, prompts):
    """(the tokens before, the drafts) of every proposal of two greedy runs of the prompts, the second from the
    prefix cache."""
    llm = speculating(LLM(target[0], dtype="float32", speculative=f"eagle3:{head[0]},k=3",
                          **ENGINES[request.param]))
    drafter, recorded = llm.core.speculator.drafter, []
    propose = drafter.propose_batch

    def recording(seqs, ks):
        drafts = propose(seqs, ks)
        recorded.extend((list(seq.token_ids), list(draft)) for seq, draft in zip(seqs, drafts))
        return drafts

    drafter.propose_batch = recording
    for _ in range(2):
        outputs(llm, prompts, SamplingParams(temperature=0, max_tokens=NEW))
    assert llm.core.block_manager.num_hit_tokens > 0
    return recorded


def test_the_heads_drafts_equal_the_published_architectures(target, head, proposals):
    assert len(proposals) > 20 and all(drafts for _, drafts in proposals)
    for tokens, drafts in proposals:
        assert reference_drafts(target[1], head[1], tokens, len(drafts)) == drafts


def test_grammar_constrained_greedy_outputs_with_eagle3_drafts_equal_those_without(target, head, prompts):
    info = xgrammar.TokenizerInfo(tiny_vocabulary(), vocab_size=TARGET["vocab_size"], stop_token_ids=[0])
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    params = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[0])
    expected = outputs(LLM(target[0], dtype="float32"), prompts, params, [GrammarConstraint(grammar) for _ in prompts])
    llm = speculating(LLM(target[0], dtype="float32", speculative=f"eagle3:{head[0]},k=3"))
    assert outputs(llm, prompts, params, [GrammarConstraint(grammar) for _ in prompts]) == expected
    assert_all_blocks_free(llm)


def test_sampled_requests_with_eagle3_drafts_take_their_tokens_and_give_back_their_blocks(target, head, prompts):
    llm = speculating(LLM(target[0], dtype="float32", speculative=f"eagle3:{head[0]},k=4"))
    params = SamplingParams(temperature=0.8, max_tokens=NEW, ignore_eos=True)
    assert [len(tokens) for tokens in outputs(llm, prompts, params)] == [NEW] * len(prompts)
    assert llm.core.stats()["spec_drafted_tokens"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mutation", [{"layers": [1, 2, 3]}, {"swap_concat": True}, {"shift": 0}])
def test_the_reference_tells_a_wrong_head_apart(target, head, proposals, mutation):
    assert any(reference_drafts(target[1], head[1], tokens, len(drafts), **mutation) != drafts
               for tokens, drafts in proposals)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 32, "intermediate_size": 48}, "hidden_size.* is 32, the target model's 64"),
    ({"vocab_size": 500}, "vocab_size is 500, the target model's 384"),
    ({"aux_layers": None}, "eagle_aux_hidden_state_layer_ids"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_at_start(target, tmp_path, change, message):
    change = dict(change)
    aux_layers = change.pop("aux_layers", AUX_LAYERS)
    save_head(tmp_path, HEAD | change, aux_layers)
    with pytest.raises(ValueError, match=f"HFENDPOINT_SPECULATIVE=eagle3:{re.escape(str(tmp_path))}.*{message}"):
        LLM(target[0], dtype="float32", speculative=f"eagle3:{tmp_path}")


def test_a_head_directory_without_a_checkpoint_is_refused_at_start(target, tmp_path):
    with pytest.raises(ValueError, match="HFENDPOINT_SPECULATIVE=eagle3:.*holds no config.json: give the directory"):
        LLM(target[0], dtype="float32", speculative=f"eagle3:{tmp_path}")


@pytest.mark.parametrize("raw, parsed", [("eagle3:/heads/Q8b,k=3", ("eagle3", 3, "/heads/Q8b")),
                                         ("EAGLE3:/heads/a,b", ("eagle3", 4, "/heads/a,b")),
                                         ("eagle3: /heads/x ", ("eagle3", 4, "/heads/x"))])
def test_the_eagle3_setting_parses(raw, parsed):
    assert parse_speculative(raw) == parsed


@pytest.mark.parametrize("raw", ["eagle3", "eagle3:", "eagle3:/h,k=0", "eagle3:,k=2"])
def test_a_bad_eagle3_setting_names_the_variable(raw):
    with pytest.raises(ValueError, match="HFENDPOINT_SPECULATIVE.*eagle3:PATH"):
        EngineConfig.from_env("model", {"HFENDPOINT_SPECULATIVE": raw})
