"""What the chat service's encoding needs is made while the weights load (EncodingParts): the service takes those
grammars only when they were made for its engine's vocabulary size, stop tokens and grammar size limit, and the
bound on characters per token and the serialized tokenizer info made with them, so that none is made between the
engine's readiness and serving."""
from fake_engine import FakeWorker
from handler.chat import max_chars_per_token
from handler.service import EncodingParts, Service, stop_tokens


def test_the_service_takes_the_grammars_made_for_its_engine(smollm2_path, smollm2_tokenizer):
    worker = FakeWorker(smollm2_path)
    parts = EncodingParts.of(smollm2_tokenizer, (worker.vocab_size, worker.eos_token_ids))
    grammars = parts.grammars
    assert "info_json" in vars(grammars)  # the cached property, filled on the loading thread before the service
    stops = stop_tokens(worker.eos_token_ids, smollm2_tokenizer)
    assert grammars.made_for(worker.vocab_size, stops, grammars.max_grammar_bytes)
    assert not grammars.made_for(worker.vocab_size + 64, stops, grammars.max_grammar_bytes)
    assert not grammars.made_for(worker.vocab_size, (*stops, 7), grammars.max_grammar_bytes)
    assert not grammars.made_for(worker.vocab_size, stops, grammars.max_grammar_bytes + 1)
    service = Service(worker, smollm2_tokenizer, "smollm2", parts=parts)
    assert service.grammars is grammars and service.chat_model.grammars is grammars
    assert service.chat_model.tokenizer is parts.shared and parts.per_thread.empty()
    assert service.chat_model.max_chars_per_token == parts.max_chars_per_token == max_chars_per_token(
        smollm2_tokenizer) is not None


def test_stop_tokens_are_the_models_then_the_tokenizers(smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    assert stop_tokens((5, eos, 6), smollm2_tokenizer) == (5, eos, 6)
    assert stop_tokens((5,), smollm2_tokenizer) == (5, eos)
