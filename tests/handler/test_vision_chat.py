"""Images in chat through our front and `python -m handler` with the openai client, on a tiny random Gemma 3
multimodal checkpoint: a data-URL image and the same image fetched from a local HTTP server (its loopback address
allowed by the operator's switch) answer transformers' greedy tokens; a private address, and an image over the
byte limit, are 400s naming the part."""
import base64
import io
import sys

import openai
import pytest
import torch
from aiohttp import web
from PIL import Image
from transformers import AutoProcessor
from vision_models import greedy_with_images, save_gemma3_vision, save_processor

pytestmark = pytest.mark.slow

MAX_BYTES = 4096
NEW = 6


def png(size: int, seed: int) -> bytes:
    pixels = torch.randint(0, 256, (size, size, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


SMALL, LARGE = png(16, 1), png(64, 2)  # under and over MAX_BYTES


@pytest.fixture(scope="module")
def served(tmp_path_factory, hosted_front):
    """(front, reference model, processor, base URL of a loopback server holding SMALL at /small.png)."""
    path = tmp_path_factory.mktemp("gemma3-vision-served")
    reference = save_gemma3_vision(path)
    save_processor(path)
    env = {"MODEL_ID": str(path), "HFENDPOINT_DEVICE": "cpu", "HFENDPOINT_MAX_MODEL_LEN": "256",
           "HFENDPOINT_REPOSITORY_DIR": "/nonexistent", "HF_HUB_OFFLINE": "1", "HFENDPOINT_MODEL_NAME": "gemma3-vision",
           "HFENDPOINT_IMAGE_URL_ALLOWED_NETWORKS": "127.0.0.1/32", "HFENDPOINT_IMAGE_MAX_BYTES": str(MAX_BYTES)}
    front = hosted_front([sys.executable, "-m", "handler"], env)

    async def serve_images():
        async def small(request):
            return web.Response(body=SMALL, content_type="image/png")
        app = web.Application()
        app.router.add_get("/small.png", small)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    images = front.run(serve_images())
    yield front, reference, AutoProcessor.from_pretrained(path), f"http://127.0.0.1:{images.addresses[0][1]}"
    front.run(images.cleanup())
    assert front.stop() == 0


def ask(front, url: str) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=300) as client:
        return client.chat.completions.create(model="gemma3-vision", max_tokens=NEW, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "w10 w11"},
                                         {"type": "image_url", "image_url": {"url": url}}]}])


def expected_text(reference, processor, image: bytes) -> tuple[str, int]:
    """transformers' greedy answer for the request's prompt and image, decoded, and the prompt's length."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "w10 w11"}, {"type": "image"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(image))], return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    tokens, _ = greedy_with_images(reference, prompt, inputs["pixel_values"], NEW)
    return processor.tokenizer.decode(tokens, skip_special_tokens=True), len(prompt)


def test_data_url_and_http_url_images_are_answered(served):
    front, reference, processor, images = served
    text, prompt_tokens = expected_text(reference, processor, SMALL)
    data_url = f"data:image/png;base64,{base64.b64encode(SMALL).decode()}"
    for url in (data_url, f"{images}/small.png"):
        reply = ask(front, url)
        assert reply.choices[0].message.content.split() == text.split()  # words: one token each
        assert reply.usage.prompt_tokens == prompt_tokens


@pytest.mark.parametrize(("url", "error"), [
    ("http://10.0.0.1/a.png", "10.0.0.1 is not a public address"),
    (f"data:image/png;base64,{base64.b64encode(LARGE).decode()}", f"HFENDPOINT_IMAGE_MAX_BYTES={MAX_BYTES}"),
])
def test_private_addresses_and_oversized_images_are_400s(served, url, error):
    with pytest.raises(openai.BadRequestError, match=error) as refused:
        ask(served[0], url)
    assert "messages[0].content[1].image_url" in str(refused.value)
