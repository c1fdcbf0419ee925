"""The BERT encoder path against sentence-transformers (all-MiniLM-L6-v2) and transformers (tiny random models)."""
import asyncio
import random

import pytest
import torch
import transformers
from model_packages import minilm_dir_or_skip
from transformers import AutoConfig, AutoTokenizer

from engine import Worker
from engine.config import EngineConfig
from engine.embedding import Embedder, longest_first_batches
from models import load_model
from models.bert import BertModel, load_bert

pytestmark = pytest.mark.slow  # the packaged MiniLM against sentence-transformers

MIN_COSINE = 0.9999

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or first new "
         "also had one has their after two not but its been who other time have during they more most world "
         "embedding transformer photosynthesis unbelievably mitochondria cryptocurrency naïve café jalapeño "
         "Zürich 東京 Ελλάδα 3.14159 #hashtag e-mail O'Reilly well-known state-of-the-art").split()


def make_texts(count: int = 60, seed: int = 0) -> list[str]:
    """Texts from one word to far past the model's 256 word pieces, spread evenly on a log scale."""
    rng = random.Random(seed)
    texts = ["Hello", "  leading and trailing spaces  ", "Punctuation!!! ?? ... ;-)", "UPPER lower MiXeD"]
    generated = count - len(texts)
    for i in range(generated):
        n_words = round(600 ** (i / (generated - 1)))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(n_words)))
    return texts


def runner_for(model_dir: str, max_embedding_batch_tokens: int = 16384) -> Embedder:
    loaded = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert loaded.kind == "encoder" and isinstance(loaded.model, BertModel)
    config = EngineConfig(model=model_dir, device="cpu", max_embedding_batch_tokens=max_embedding_batch_tokens)
    return Embedder.for_encoder(config, loaded)


@pytest.fixture(scope="module")
def minilm_path() -> str:
    return minilm_dir_or_skip()


@pytest.fixture(scope="module")
def runner(minilm_path):
    return runner_for(minilm_path)


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="module")
def st_model(minilm_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(minilm_path, device="cpu")


@pytest.fixture(scope="module")
def texts():
    return make_texts()


def our_token_ids(tokenizer, runner, texts):
    """What the tokenize handler does for an encoder model."""
    return tokenizer(texts, add_special_tokens=True, truncation=True, max_length=runner.max_model_len)["input_ids"]


@pytest.fixture(scope="module")
def our_vectors(tokenizer, runner, texts):
    return runner.embed(our_token_ids(tokenizer, runner, texts))


def st_token_ids(st_model, texts):
    features = st_model.preprocess(texts) if hasattr(st_model, "preprocess") else st_model.tokenize(texts)
    return [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"])]


def test_limits_follow_sentence_transformers(runner, st_model):
    assert runner.max_model_len == st_model.max_seq_length == 256
    assert runner.hidden_size == 384
    assert (runner.pooling.mode, runner.pooling.normalize) == ("mean", True)


def test_tokenization_matches_sentence_transformers(tokenizer, runner, st_model, texts):
    ours = our_token_ids(tokenizer, runner, texts)
    assert ours == st_token_ids(st_model, texts)
    untruncated = tokenizer(texts)["input_ids"]
    assert max(len(ids) for ids in untruncated) > 2 * runner.max_model_len
    assert min(len(ids) for ids in untruncated) == 3


def test_vectors_match_sentence_transformers(our_vectors, st_model, texts):
    ours = our_vectors
    expected = torch.from_numpy(st_model.encode(texts, normalize_embeddings=True))
    assert ours.dtype == torch.float32 and ours.shape == expected.shape == (len(texts), 384)
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(texts)))
    cosines = (ours * expected).sum(dim=1)
    print(f"cosine with sentence-transformers over {len(texts)} texts: min {cosines.min():.7f}, "
          f"mean {cosines.mean():.7f}")
    assert cosines.min().item() >= MIN_COSINE, f"worst text: {texts[cosines.argmin()]!r}"


def test_overlong_token_lists_are_refused_not_cut(tokenizer, runner, texts):
    """Truncation is the caller's choice (the handler's truncate_prompt_tokens): the engine cuts nothing."""
    long_ids = [ids for ids in tokenizer(texts)["input_ids"] if len(ids) > runner.max_model_len]
    assert long_ids
    with pytest.raises(ValueError, match=f"input 0 has {len(long_ids[0])} tokens, more than the model's limit of 256"):
        runner.embed(long_ids[:1])


def test_small_batches_give_the_same_vectors_in_caller_order(minilm_path, tokenizer, runner, texts, our_vectors):
    token_lists = our_token_ids(tokenizer, runner, texts)
    shuffled = list(range(len(texts)))
    random.Random(1).shuffle(shuffled)
    small = runner_for(minilm_path, max_embedding_batch_tokens=300)
    assert len(longest_first_batches(token_lists, small.max_batch_tokens)) > 10
    got = small.embed([token_lists[i] for i in shuffled])
    torch.testing.assert_close(got, our_vectors[shuffled], rtol=1e-5, atol=1e-5)


def test_batches_pack_longest_first_within_budget():
    token_lists = [[101] + [1000] * n + [102] for n in (5, 254, 40, 1, 200, 90)]
    groups = longest_first_batches(token_lists, 300)
    assert groups == [[1], [4, 5], [2, 0, 3]]
    assert all(sum(len(token_lists[i]) for i in group) <= 300 for group in groups)


@pytest.mark.parametrize("bad, message", [([], "input 1 is empty"), ([101, 30522, 102], "token id 30522"),
                                          ([101, -1, 102], "token id -1"),
                                          ([101] + [1000] * 255 + [102],
                                           "input 1 has 257 tokens, more than the model's limit of 256")])
def test_bad_input_is_refused_and_the_runner_keeps_working(runner, bad, message):
    good = [101, 7592, 102]
    with pytest.raises(ValueError, match=message):
        runner.embed([good, bad])
    assert runner.embed([good]).shape == (1, 384)


TINY = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=80)


@pytest.mark.parametrize("model_class, config_class, extra", [
    (transformers.BertModel, transformers.BertConfig, {}),
    (transformers.BertForMaskedLM, transformers.BertConfig, {"hidden_act": "gelu_new"}),
    (transformers.RobertaModel, transformers.RobertaConfig, {"type_vocab_size": 1}),
    (transformers.XLMRobertaModel, transformers.XLMRobertaConfig, {"pad_token_id": 1}),
])
def test_hidden_states_match_transformers(tmp_path, model_class, config_class, extra):
    torch.manual_seed(0)
    reference = model_class(config_class(**TINY, **extra)).eval()
    reference.save_pretrained(tmp_path)
    hf_config = AutoConfig.from_pretrained(tmp_path)
    ours = load_bert(str(tmp_path), hf_config, torch.float32, torch.device("cpu"))
    assert isinstance(ours, BertModel)
    lengths = [1, 9, 37, hf_config.max_position_embeddings - ours.embeddings.position_offset]
    sequences = [torch.randint(3, TINY["vocab_size"], (n,)) for n in lengths]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    hidden = ours(torch.cat(sequences), positions, cu_seqlens, max(lengths))
    base = getattr(reference, "bert", reference)
    with torch.no_grad():
        expected = torch.cat([base(ids[None]).last_hidden_state[0] for ids in sequences])
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)


def test_token_type_ids_are_used(tmp_path):
    torch.manual_seed(0)
    reference = transformers.BertModel(transformers.BertConfig(**TINY)).eval()
    reference.save_pretrained(tmp_path)
    ours = load_bert(str(tmp_path), AutoConfig.from_pretrained(tmp_path), torch.float32, torch.device("cpu"))
    ids, types = torch.randint(3, 120, (12,)), torch.tensor([0] * 5 + [1] * 7)
    hidden = ours(ids, torch.arange(12), torch.tensor([0, 12], dtype=torch.int32), 12, token_type_ids=types)
    with torch.no_grad():
        expected = reference(ids[None], token_type_ids=types[None]).last_hidden_state[0]
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)


def test_unsupported_variants_are_refused_by_name():
    with pytest.raises(ValueError, match="relative_key"):
        BertModel(transformers.BertConfig(**TINY, position_embedding_type="relative_key"))
    with pytest.raises(ValueError, match="relu"):
        BertModel(transformers.BertConfig(**TINY, hidden_act="relu"))


def test_missing_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    transformers.BertModel(transformers.BertConfig(**TINY)).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["encoder.layer.1.attention.self.value.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.qkv_proj\.weight"):
        load_bert(str(tmp_path), AutoConfig.from_pretrained(tmp_path), torch.float32, torch.device("cpu"))


def test_worker_batches_concurrent_calls_into_the_same_vectors(minilm_path, tokenizer, runner, texts, our_vectors):
    token_lists = our_token_ids(tokenizer, runner, texts)
    worker = Worker(EngineConfig(model=minilm_path, device="cpu", dtype="float32"))
    try:
        assert (worker.kind, worker.max_model_len, worker.max_embedding_tokens, worker.hidden_size) == (
            "encoder", 256, 256, 384)

        async def embed_concurrently():
            calls = [worker.embed(token_lists[i:i + 7]) for i in range(0, len(token_lists), 7)]
            return [vector for result in await asyncio.gather(*calls) for vector in result]
        got = torch.tensor(asyncio.run(embed_concurrently()))
    finally:
        worker.shutdown()
    torch.testing.assert_close(got, our_vectors, rtol=1e-5, atol=1e-5)
