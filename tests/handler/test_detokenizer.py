"""Streaming detokenization: whole characters only, stop strings never leak, held-back text is flushed."""

from tokenizers import Tokenizer, decoders, models

from handler.detokenizer import Detokenizer


def stream(detokenizer: Detokenizer, token_ids) -> list[str]:
    pieces = []
    for token_id in token_ids:
        pieces.append(detokenizer.add(token_id))
        if detokenizer.stopped:
            break
    return pieces


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_multibyte_characters_split_across_byte_level_tokens(smollm2_tokenizer):
    text = "héllo 日本語 😀 wörld"
    ids = encode(smollm2_tokenizer, text)
    pieces = stream(Detokenizer(smollm2_tokenizer.backend_tokenizer, []), ids)
    assert "".join(pieces) == text
    assert "" in pieces, "some character should span several tokens, or this test checks nothing"
    assert not any("\ufffd" in piece for piece in pieces)


def byte_fallback_tokenizer() -> Tokenizer:
    """A sentencepiece-style tokenizer: unknown characters become <0xNN> byte tokens."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for word in ["<unk>", "▁The", "▁capital", "▁is", "▁Paris", "."]:
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence(  # Llama 2's decoder
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def test_byte_fallback_tokens_never_produce_broken_utf8():
    tokenizer = byte_fallback_tokenizer()
    word = [tokenizer.token_to_id(t) for t in ["▁The", "▁capital", "▁is"]]
    nihon = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in "日本".encode()]
    ids = word + nihon + [tokenizer.token_to_id("▁Paris"), tokenizer.token_to_id(".")]
    pieces = stream(Detokenizer(tokenizer, []), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == "The capital is日本 Paris."
    assert pieces[3:9] == ["", "", "日", "", "", "本"]


def test_first_token_keeps_its_leading_space_after_the_prompt():
    tokenizer = byte_fallback_tokenizer()
    prompt = [tokenizer.token_to_id("▁The")]
    pieces = stream(Detokenizer(tokenizer, prompt), [tokenizer.token_to_id("▁capital")])
    assert pieces == [" capital"]


def test_stop_string_across_token_boundaries_is_cut_and_never_released(smollm2_tokenizer):
    text = "The capital of France is Paris."
    ids = encode(smollm2_tokenizer, text)
    detokenizer = Detokenizer(smollm2_tokenizer.backend_tokenizer, [], stop=["France is"])
    pieces = stream(detokenizer, ids)
    assert detokenizer.stopped
    assert "".join(pieces) == "The capital of "
    assert len(pieces) < len(ids), "the stream should stop at the token completing the stop string"


def test_stop_string_inside_one_token(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "The capital of France")
    detokenizer = Detokenizer(smollm2_tokenizer.backend_tokenizer, [], stop=["apit"])
    assert "".join(stream(detokenizer, ids)) == "The c"
    assert detokenizer.stopped


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "one two three four")
    detokenizer = Detokenizer(smollm2_tokenizer.backend_tokenizer, [], stop=["four", "two three"])
    assert "".join(stream(detokenizer, ids)) == "one "
    assert detokenizer.stop_string == "two three", "the stop string found is named"


def test_held_back_text_is_flushed_when_no_stop_string_completes(smollm2_tokenizer):
    text = "The capital of France is Paris"
    ids = encode(smollm2_tokenizer, text)
    detokenizer = Detokenizer(smollm2_tokenizer.backend_tokenizer, [], stop=["Paris!"])
    released = "".join(stream(detokenizer, ids))
    assert not detokenizer.stopped and detokenizer.stop_string is None
    assert released == "The capital of France is ", "the possible start of the stop string is held back"
    assert released + detokenizer.flush() == text
    assert detokenizer.flush() == ""


def test_special_tokens_are_not_text(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "Paris") + [smollm2_tokenizer.eos_token_id]
    assert "".join(stream(Detokenizer(smollm2_tokenizer.backend_tokenizer, []), ids)) == "Paris"


def test_kept_special_tokens_decode_to_their_text(smollm2_tokenizer):
    """A tool-call marker that the tokenizer makes a special token (Llama's <|python_tag|>, Mistral's
    [TOOL_CALLS]) must reach the parser; other special tokens still decode to nothing."""
    start, end = smollm2_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [start, *encode(smollm2_tokenizer, "call"), end]
    kept = Detokenizer(smollm2_tokenizer.backend_tokenizer, [], kept_tokens={start: "<|im_start|>"})
    assert "".join(stream(kept, ids)) == "<|im_start|>call"
    assert "".join(stream(Detokenizer(smollm2_tokenizer.backend_tokenizer, []), ids)) == "call"
