"""Gemma 3 with images through engine.LLM on a tiny random multimodal checkpoint: greedy tokens, and the
log-probability of each, equal transformers' generate with one image and with two, whole, in chunks that would
split an image, and preempted; the image encoder equals transformers'; the prefix cache shares the text before
an image but nothing from an image on when the image differs."""
import asyncio
import dataclasses

import pytest
import torch
from vision_models import (
    IMAGE_SIZE,
    assert_same,
    generated,
    graphs_that_hold_no_images,
    greedy_with_images,
    image_prompt,
    save_gemma3_vision,
)

import kernels
from engine import LLM, EngineConfig, PromptRejected, SamplingParams
from engine.data_parallel import DataParallelWorker
from engine.images import PromptImage, fit_chunk
from models import load_model

NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-vision")
    return str(path), save_gemma3_vision(path)


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def prompts(prompts_of_lengths):
    """(prompt, indices of its images among `pixels`): one image after 10 text tokens, then two images."""
    first, second = prompts_of_lengths([40, 34], seed=3, vocab=380)
    return [(image_prompt(first, 10), [0]), (image_prompt(second, 3, 15), [1, 2])]


@pytest.fixture(scope="module")
def expected(checkpoint, pixels, prompts):
    """transformers' greedy tokens and their log-probabilities for each prompt."""
    return [greedy_with_images(checkpoint[1], prompt, pixels[indices], NEW) for prompt, indices in prompts]


def engine_images(pixels, indices) -> list[PromptImage]:
    return [PromptImage.of_pixels(pixels[i]) for i in indices]


def outputs(llm: LLM, prompts, pixels) -> list[tuple[list[int], list[float]]]:
    return generated(llm, [prompt for prompt, _ in prompts], [engine_images(pixels, indices) for _, indices in prompts],
                     GREEDY)


def test_image_encoder_equals_transformers(checkpoint, pixels):
    path, reference = checkpoint
    encoder = load_model(path, torch.float32, torch.device("cpu")).vision
    with torch.inference_mode():
        expected = reference.model.get_image_features(pixels).pooler_output
        torch.testing.assert_close(encoder(pixels), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_batched_tokens": 6},  # chunks of 6 would end inside every image: they stop before it instead
    {"num_kv_blocks": 6, "block_size": 16},  # both prompts fit, not both as they grow: one is preempted
])
def test_greedy_with_images_matches_transformers(checkpoint, pixels, prompts, expected, engine):
    llm = LLM(checkpoint[0], dtype="float32", **engine)
    for got, want in zip(outputs(llm, prompts, pixels), expected):
        assert_same(got, want)
    if "num_kv_blocks" in engine:
        assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.block_manager.num_free_blocks == llm.core.runner.num_blocks


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA every test above runs the Triton kernel")
@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 6}, {"num_kv_blocks": 6, "block_size": 16}])
def test_images_through_the_triton_prefill_kernel(checkpoint, pixels, prompts, expected, engine, monkeypatch):
    """The steps with image spans run our Triton prefill kernel (interpreted here), as on CUDA: the spans the
    engine builds, whole images and chunks after a cached prefix, in full and sliding layers."""
    from kernels import triton_attention

    cpu = kernels._backend("cpu")
    torch_attention, spanned = cpu.paged_attention, []

    def attention(q, k_cache, v_cache, meta, *args):
        if meta.image_spans is None:
            return torch_attention(q, k_cache, v_cache, meta, *args)
        spanned.append(meta.image_spans)
        return triton_attention.paged_attention(q, k_cache, v_cache, meta, *args)

    monkeypatch.setattr(cpu, "paged_attention", attention)
    llm = LLM(checkpoint[0], dtype="float32", **engine)
    for got, want in zip(outputs(llm, prompts, pixels), expected):
        assert_same(got, want)
    assert spanned


def test_a_different_image_does_not_hit_the_prefix_cache(checkpoint, pixels, prompts, expected):
    """Blocks of 4: the two blocks before the image (at 11..14) are shared; from the image's block on, only the
    same image hits."""
    path, reference = checkpoint
    llm = LLM(path, dtype="float32", block_size=4)
    prompt, _ = prompts[0]
    manager = llm.core.block_manager
    other_image = greedy_with_images(reference, prompt, pixels[[1]], NEW)
    for indices, expected_hits, want in (([0], 0, expected[0]), ([1], 8, other_image),
                                         ([0], (len(prompt) - 1) // 4 * 4, expected[0])):
        hits = manager.num_hit_tokens
        (got,) = outputs(llm, [(prompt, indices)], pixels)
        assert manager.num_hit_tokens - hits == expected_hits
        assert_same(got, want)


def test_steps_with_images_run_eagerly(checkpoint, pixels, prompts, expected, monkeypatch):
    """On CUDA every prefill size has a graph once the warm-up is done (after the first decode step): a later
    prompt with an image must not replay one."""
    llm = LLM(checkpoint[0], dtype="float32")
    graphs_that_hold_no_images(llm.core.runner, monkeypatch)
    for got, want in zip(outputs(llm, prompts, pixels), expected):
        assert_same(got, want)


def test_chunks_stop_before_an_image_or_take_all_of_it():
    image = PromptImage(None, key=0, offset=11, length=4)
    assert fit_chunk([image], 6, 6) == 5  # would end at 12, inside: stops at 11
    assert fit_chunk([image], 11, 3) == 0  # the image's rest does not fit
    assert fit_chunk([image], 12, 3) == 3  # a prefix hit inside the image: its rest, whole
    assert fit_chunk([image], 0, 11) == 11


def test_prompts_and_images_must_match(checkpoint, pixels, prompts):
    llm = LLM(checkpoint[0], dtype="float32")
    prompt, _ = prompts[0]
    with pytest.raises(ValueError, match="1 runs of the image token .* but 2 images"):
        llm.generate([prompt], GREEDY, images=[engine_images(pixels, [0, 1])])
    with pytest.raises(ValueError, match="pixel values of shape"):
        llm.generate([prompt], GREEDY, images=[[PromptImage.of_pixels(torch.zeros(3, 8, 8))]])


def test_data_parallel_engines_read_images(checkpoint, pixels, prompts, expected):
    """Two engines in processes of their own: the images travel with their requests and give transformers'
    tokens; an image over the step budget is refused at submit, as one engine refuses it."""
    worker = DataParallelWorker(EngineConfig(checkpoint[0], device="cpu", dtype="float32", data_parallel_size=2))
    assert worker.reads_images

    async def main():
        queues = [worker.submit(i, prompt, GREEDY, images=engine_images(pixels, indices))
                  for i, (prompt, indices) in enumerate(prompts)]
        return await asyncio.gather(*(collected(queue) for queue in queues))

    try:
        for got, want in zip(asyncio.run(main()), expected):
            assert_same(got, want)
        prompt, indices = prompts[0]
        worker.config = dataclasses.replace(worker.config, max_num_batched_tokens=3)
        with pytest.raises(PromptRejected, match="more than the step budget"):
            worker.submit("large", prompt, GREEDY, images=engine_images(pixels, indices))
    finally:
        worker.shutdown()


async def collected(queue) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    while True:
        output = await queue.get()
        tokens += output.new_token_ids
        logprobs += [logprob for logprob, *_ in output.logprobs or ()]
        if output.finish_reason:
            return tokens, logprobs
