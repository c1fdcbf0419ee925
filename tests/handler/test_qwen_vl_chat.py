"""Images in chat for a tiny random Qwen2.5-VL checkpoint: the handler's prompt and patches equal what the model's
own image processor and template make (each image resized within its min and max pixels, its pad token repeated
once per merged patch), and through our front and `python -m handler` with the openai client a data-URL image is
answered with transformers' greedy tokens."""
import base64
import io
import sys

import openai
import pytest
import torch
from PIL import Image
from qwen_vl_models import greedy_with_images, processed, save_processor, save_qwen2_5_vl

from handler.chat import ChatModel, parse_chat_request
from handler.images import ImageSource, VisionPrompt

NEW = 6
QUESTION = {"type": "text", "text": "w10 w11"}


def png(width: int, height: int, seed: int) -> bytes:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


def data_url(encoded: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(encoded).decode()}"


def opened(images: list[bytes]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(image)) for image in images]


def test_prompt_and_patches_equal_the_processors(tmp_path):
    tokenizer, image_processor = save_processor(tmp_path)
    model = ChatModel(tokenizer, 4096, (), {}, vision=VisionPrompt.load(str(tmp_path), 10**6))
    images = [png(40, 24, seed=1), png(90, 60, seed=2)]  # the second over max_pixels: resized down
    data = {"messages": [{"role": "user", "content": [
        QUESTION, {"type": "image_url", "image_url": {"url": data_url(images[0])}}, {"type": "text", "text": "w7"},
        {"type": "image_url", "image_url": {"url": data_url(images[1])}}]}]}
    sources = [ImageSource(f"messages[0].content[{j}].image_url", base64.b64encode(image).decode())
               for j, image in zip((1, 3), images)]
    request = parse_chat_request(data, model, sources)
    prompt, inputs = processed(tokenizer, image_processor,
                               [QUESTION, {"type": "image"}, {"type": "text", "text": "w7"}, {"type": "image"}],
                               opened(images))
    assert request.prompt_token_ids == prompt
    grids = inputs["image_grid_thw"].tolist()
    assert [list(image.grid) for image in request.images] == grids and grids[0] != grids[1]
    torch.testing.assert_close(torch.cat([image.pixel_values for image in request.images]),
                               inputs["pixel_values"].float())


@pytest.mark.slow
def test_a_data_url_image_is_answered(tmp_path, hosted_front):
    reference = save_qwen2_5_vl(tmp_path)
    tokenizer, image_processor = save_processor(tmp_path)
    env = {"MODEL_ID": str(tmp_path), "HFENDPOINT_DEVICE": "cpu", "HFENDPOINT_MAX_MODEL_LEN": "256",
           "HFENDPOINT_REPOSITORY_DIR": "/nonexistent", "HF_HUB_OFFLINE": "1", "HFENDPOINT_MODEL_NAME": "qwen-vl"}
    front = hosted_front([sys.executable, "-m", "handler"], env)
    try:
        image = png(40, 24, seed=3)
        prompt, inputs = processed(tokenizer, image_processor, [QUESTION, {"type": "image"}], opened([image]))
        tokens, _ = greedy_with_images(reference, prompt, [inputs["pixel_values"]], inputs["image_grid_thw"].tolist(),
                                       NEW)
        with openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=300) as client:
            reply = client.chat.completions.create(model="qwen-vl", max_tokens=NEW, temperature=0, messages=[
                {"role": "user", "content": [QUESTION, {"type": "image_url", "image_url": {"url": data_url(image)}}]}])
        assert reply.choices[0].message.content.split() == tokenizer.decode(tokens, skip_special_tokens=True).split()
        assert reply.usage.prompt_tokens == len(prompt)
    finally:
        assert front.stop() == 0
