"""Image parts of chat requests (handler/images.py): the prompt and pixels equal the model's own processor's,
bad images are 400s naming the part, and image URLs reach only public addresses unless the operator allows a
network, through redirects too."""
import asyncio
import base64
import io
import ipaddress

import pytest
import torch
from aiohttp import web
from PIL import Image
from transformers import AutoProcessor
from vision_models import save_processor

from daemon_protocol import RequestError
from handler.chat import ChatModel, parse_chat_request
from handler.image_fetch import CheckingResolver, ImageFetcher, UnfetchableAddress, fetchable
from handler.images import ImageSource, VisionPrompt
from handler.settings import HandlerSettings

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-processor")
    save_processor(path)
    return str(path)


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


def data_url(encoded: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(encoded).decode()}"


def chat(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 4}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def gather(data, **settings) -> list[ImageSource]:
    return asyncio.run(ImageFetcher(HandlerSettings(**settings)).gather(data))


def test_prompt_and_pixels_equal_the_processors(processor_dir):
    processor = AutoProcessor.from_pretrained(processor_dir)
    model = ChatModel(processor.tokenizer, 4096, (), {}, vision=VisionPrompt.load(processor_dir, 10**6))
    images = [png(90, 60, seed=1), png(40, 70, seed=2)]
    data = chat({"type": "text", "text": "w5 w6"}, image_part(data_url(images[0])), {"type": "text", "text": "w7"},
                image_part(data_url(images[1], "image/webp")))
    request = parse_chat_request(data, model, gather(data))
    template_messages = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "image"},
                                                      {"type": "text", "text": "w7"}, {"type": "image"}]}]
    text = processor.tokenizer.apply_chat_template(template_messages, tokenize=False, add_generation_prompt=True)
    expected = processor(text=text, images=[Image.open(io.BytesIO(image)) for image in images], return_tensors="pt")
    assert request.prompt_token_ids == expected["input_ids"][0].tolist()
    for image, pixels in zip(request.images, expected["pixel_values"]):
        torch.testing.assert_close(image.pixel_values, pixels.float())
    assert request.images[0].key != request.images[1].key


@pytest.mark.parametrize(("url", "settings", "error"), [
    ("data:image/png;base64,!!!", {}, "not valid base64"),
    (data_url(b"not an image at all"), {}, "not an image this server can read"),
    (data_url(png(30, 30)), {"image_max_pixels": 899}, "30x30 pixels, more than HFENDPOINT_IMAGE_MAX_PIXELS=899"),
    (data_url(png(30, 30)), {"image_max_bytes": 100}, "larger than HFENDPOINT_IMAGE_MAX_BYTES=100"),
    ("data:text/plain;base64,aGk=", {}, "data:image/<type>;base64"),
    ("ftp://example.com/a.png", {}, "data: URL or an http"),
    ("http://10.1.2.3/a.png", {}, "10.1.2.3 is not a public address"),
    ("http://169.254.169.254/latest/meta-data", {}, "not a public address"),
    ("http://[::ffff:127.0.0.1]/a.png", {}, "not a public address"),
])
def test_bad_images_are_refused_naming_the_part(processor_dir, url, settings, error):
    processor = AutoProcessor.from_pretrained(processor_dir)
    model = ChatModel(processor.tokenizer, 4096, (), {},
                      vision=VisionPrompt.load(processor_dir, settings.get("image_max_pixels", 10**6)))
    data = chat({"type": "text", "text": "w1"}, image_part(url))
    with pytest.raises(RequestError, match=error) as refused:
        parse_chat_request(data, model, gather(data, **settings))
    assert str(refused.value).startswith("messages[0].content[1].image_url")


def test_images_per_request_are_limited():
    data = chat(*[image_part(data_url(png(8, 8)))] * 3)
    with pytest.raises(RequestError, match=r"messages\[0\].content\[2\].image_url: at most 2 images"):
        gather(data, max_images_per_request=2)


def test_a_model_without_vision_refuses_image_parts(processor_dir):
    model = ChatModel(AutoProcessor.from_pretrained(processor_dir).tokenizer, 4096, (), {})
    with pytest.raises(RequestError, match=r"messages\[0\].content\[0\]: this model does not read images"):
        parse_chat_request(chat(image_part(data_url(png(8, 8)))), model)


def test_only_public_or_allowed_addresses_are_fetchable():
    for address in ("127.0.0.1", "10.0.0.1", "192.168.1.1", "172.16.0.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
                    "::1", "fe80::1", "fc00::1", "::ffff:10.0.0.1", "224.0.0.1"):
        assert not fetchable(ipaddress.ip_address(address)), address
    assert fetchable(ipaddress.ip_address("8.8.8.8")) and fetchable(ipaddress.ip_address("2001:4860:4860::8888"))
    assert fetchable(ipaddress.ip_address("127.0.0.1"), LOOPBACK)
    assert not fetchable(ipaddress.ip_address("10.0.0.1"), LOOPBACK)


def test_a_host_name_resolving_to_loopback_is_refused():
    async def resolve():
        resolver = CheckingResolver()
        try:
            await resolver.resolve("localhost", 80)
        finally:
            await resolver.close()

    with pytest.raises(UnfetchableAddress, match="localhost resolves to"):
        asyncio.run(resolve())


def test_fetches_within_limits_and_checks_every_redirect():
    """A loopback server (its network allowed) serves an image, a redirect to it, and a redirect to a private
    address, which is refused; a body over the byte limit is refused while it is read; a missing image, a
    closed port and a server slower than the fetch timeout are refused naming the part."""
    image = png(20, 20)

    async def serve(request):
        return web.Response(body=image, content_type="image/png")

    def redirect(to: str):
        async def answer(request):
            raise web.HTTPFound(to)
        return answer

    async def slow(request):
        await asyncio.sleep(1)
        return await serve(request)

    async def run() -> list:
        app = web.Application()
        app.router.add_get("/a.png", serve)
        app.router.add_get("/slow.png", slow)
        app.router.add_get("/hop", redirect("/a.png"))
        app.router.add_get("/away", redirect("http://10.0.0.1/a.png"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        fetcher = ImageFetcher(HandlerSettings(image_url_allowed_networks=LOOPBACK))
        small = ImageFetcher(HandlerSettings(image_url_allowed_networks=LOOPBACK, image_max_bytes=len(image) - 1))
        hasty = ImageFetcher(HandlerSettings(image_url_allowed_networks=LOOPBACK, image_fetch_timeout=0.2))
        results = []
        for chosen, url in ((fetcher, base + "/a.png"), (fetcher, base + "/hop"), (fetcher, base + "/away"),
                            (small, base + "/a.png"), (ImageFetcher(HandlerSettings()), base + "/a.png"),
                            (fetcher, base + "/missing.png"), (fetcher, "http://127.0.0.1:1/a.png"),
                            (hasty, base + "/slow.png")):
            try:
                results.append((await chosen.gather(chat(image_part(url))))[0].data)
            except RequestError as exc:
                results.append(str(exc))
        await runner.cleanup()
        return results

    direct, redirected, away, too_big, default, missing, unreachable, slow_one = asyncio.run(run())
    assert direct == redirected == image
    assert "10.0.0.1 is not a public address" in away
    assert "larger than HFENDPOINT_IMAGE_MAX_BYTES" in too_big
    assert "127.0.0.1 is not a public address" in default
    assert "answered HTTP 404" in missing
    assert "took longer than HFENDPOINT_IMAGE_FETCH_TIMEOUT=0.2 s" in slow_one
    assert unreachable.startswith("messages[0].content[0].image_url: could not fetch http://127.0.0.1:1/a.png")
