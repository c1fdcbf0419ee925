"""Images in chat requests: OpenAI's `image_url` content parts -> the engine's PromptImage (pixels the model's own
image processor prepared), and the prompt's image markers expanded as the model's processor expands them.

A part's URL is a `data:` URL (base64 PNG, JPEG, WebP or anything else Pillow reads) or an http(s) URL the handler
fetches on its event loop (aiohttp), within the operator's limits (handler/settings.py): bytes per image, seconds
per fetch, images per request. A URL whose host is, or resolves to, a loopback, private, link-local or otherwise
non-public address is refused unless the operator allows its network, at every redirect too: the connection
resolves through a resolver that checks every address it returns, so the address checked is the address
connected to.
The processor's files say what an image's marker in the rendered prompt expands to: Gemma 3's fixed run of soft
tokens, or Qwen2.5-VL's image pad token once per merged patch of the grid its image processor resized the image to
(within its min and max pixels: dynamic resolution).
Decoding and preprocessing (Pillow, the processor's resize and normalisation) run on an encoding thread
(handler/service.py), never on the event loop or the engine thread. Every refusal is a 400 naming the part,
`messages[i].content[j].image_url`.
"""

import asyncio
import base64
import binascii
import io
import ipaddress
import logging
import math
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver
from PIL import Image
from yarl import URL

from daemon_protocol import RequestError
from engine.images import PromptImage

IMAGE_PART_TYPE = "image_url"
MAX_REDIRECTS = 5
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
READ_CHUNK_BYTES = 1 << 16
ALLOWED_NETWORKS_VARIABLE = "HFENDPOINT_IMAGE_URL_ALLOWED_NETWORKS"
QWEN_IMAGE_PAD = "<|image_pad|>"  # what Qwen2.5-VL's chat template writes for an image, between its vision markers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageSource:
    """An image part's encoded bytes, or its data URL's base64 text (decoded on an encoding thread), and where in
    the request it came from."""

    where: str
    data: bytes | str


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_PART_TYPE


def image_urls(data) -> list[tuple[str, str]]:
    """(where, url) of each image part of the request's messages, in the order a template meets them."""
    messages = data.get("messages") if isinstance(data, dict) else None
    found = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if is_image_part(part):
                where = f"messages[{i}].content[{j}].image_url"
                found.append((where, part_url(part.get("image_url"), where)))
    return found


def part_url(image_url, where: str) -> str:
    """The URL of an image_url part: {"url": ..., "detail": ...} as OpenAI sends it (the detail changes nothing
    for a model that reads every image at one resolution), or the URL string itself."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where} must be a map with a url string (a data: or http(s) URL)", param="messages")
    detail = image_url.get("detail") if isinstance(image_url, dict) else None
    if detail is not None and detail not in ("auto", "low", "high"):
        raise RequestError(f"{where}.detail must be auto, low or high, got {detail!r:.50}", param="messages")
    return url


class ImageFetcher:
    """Gathers a request's image parts: data URLs checked and kept, http(s) URLs fetched within the limits of
    `settings` (handler/settings.py's HandlerSettings)."""

    def __init__(self, settings):
        self.settings = settings

    async def gather(self, data) -> list[ImageSource]:
        parts = image_urls(data)
        if len(parts) > self.settings.max_images_per_request:
            raise RequestError(f"{parts[self.settings.max_images_per_request][0]}: at most "
                               f"{self.settings.max_images_per_request} images per request "
                               f"(HFENDPOINT_MAX_IMAGES_PER_REQUEST)", param="messages")
        fetched = [part for part in parts if not part[1].startswith("data:")]
        bodies = {}
        if fetched:
            async with self._session() as session:
                results = await asyncio.gather(*(self._fetch(session, url, where) for where, url in fetched))
            bodies = {where: body for (where, _), body in zip(fetched, results)}
        return [ImageSource(where, bodies[where] if where in bodies else self._data_url_payload(url, where))
                for where, url in parts]

    def _data_url_payload(self, url: str, where: str) -> str:
        header, comma, payload = url[len("data:"):].partition(",")
        media_type, *parameters = header.split(";")
        if not comma or "base64" not in parameters or not media_type.startswith("image/"):
            raise RequestError(f"{where}: a data URL must be data:image/<type>;base64,<data>", param="messages")
        if len(payload) * 3 // 4 > self.settings.image_max_bytes:
            raise too_large(where, self.settings.image_max_bytes)
        return payload

    def _session(self) -> aiohttp.ClientSession:
        resolver = CheckingResolver(self.settings.image_url_allowed_networks)
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=resolver))  # _fetch bounds the time

    async def _fetch(self, session: aiohttp.ClientSession, url: str, where: str) -> bytes:
        try:
            return await asyncio.wait_for(self._follow(session, url, where), self.settings.image_fetch_timeout)
        except (asyncio.TimeoutError, TimeoutError):
            raise RequestError(f"{where}: fetching {url:.200} took longer than HFENDPOINT_IMAGE_FETCH_TIMEOUT="
                               f"{self.settings.image_fetch_timeout:g} s", param="messages") from None
        except aiohttp.ClientError as exc:
            blocked = getattr(exc, "os_error", None)
            if isinstance(blocked, UnfetchableAddress):
                raise self._refusal(where, str(blocked)) from None
            raise RequestError(f"{where}: could not fetch {url:.200}: {exc}", param="messages") from None

    async def _follow(self, session: aiohttp.ClientSession, url: str, where: str) -> bytes:
        """The body at url, following up to MAX_REDIRECTS redirects, each checked as the first URL is."""
        for _ in range(MAX_REDIRECTS + 1):
            target = self._checked_url(url, where)
            async with session.get(target, allow_redirects=False) as response:
                location = response.headers.get("Location")
                if response.status in REDIRECT_STATUSES and location:
                    url = str(response.url.join(URL(location)))
                    continue
                if response.status != 200:
                    raise RequestError(f"{where}: fetching {url:.200} answered HTTP {response.status}",
                                       param="messages")
                return await self._read(response, where)
        raise RequestError(f"{where}: fetching {url:.200} redirected more than {MAX_REDIRECTS} times",
                           param="messages")

    def _checked_url(self, url: str, where: str) -> URL:
        try:
            parsed = URL(url)
        except ValueError:
            parsed = None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
            raise RequestError(f"{where}: the url must be a data: URL or an http(s) URL, got {url:.100}",
                               param="messages")
        try:
            address = ipaddress.ip_address(parsed.host)
        except ValueError:  # a host name: the resolver checks what it resolves to
            return parsed
        if not fetchable(address, self.settings.image_url_allowed_networks):
            raise self._refusal(where, f"{parsed.host} is not a public address")
        return parsed

    @staticmethod
    def _refusal(where: str, reason: str) -> RequestError:
        return RequestError(f"{where}: {reason}; this server fetches images from public addresses only (its operator "
                            f"can allow other networks with {ALLOWED_NETWORKS_VARIABLE})", param="messages")

    async def _read(self, response: aiohttp.ClientResponse, where: str) -> bytes:
        limit = self.settings.image_max_bytes
        if (response.content_length or 0) > limit:
            raise too_large(where, limit)
        body = bytearray()
        async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
            body += chunk
            if len(body) > limit:
                raise too_large(where, limit)
        return bytes(body)


def too_large(where: str, limit: int) -> RequestError:
    return RequestError(f"{where}: the image is larger than HFENDPOINT_IMAGE_MAX_BYTES={limit} bytes",
                        param="messages")


def fetchable(address: ipaddress.IPv4Address | ipaddress.IPv6Address, allowed_networks: tuple = ()) -> bool:
    """Whether image URLs may reach an address: one of the public internet's (not loopback, private, link-local,
    shared, reserved, multicast or unspecified), or one in a network the operator allows. An IPv4 address mapped
    into IPv6 is judged as itself."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address.version == network.version and address in network for network in allowed_networks):
        return True
    return address.is_global and not address.is_multicast


class UnfetchableAddress(OSError):
    """A host name resolved to an address the handler does not fetch from (aiohttp reports it as the connection's
    os_error)."""


class CheckingResolver(AbstractResolver):
    """aiohttp's threaded resolver, refusing a host any of whose addresses is not fetchable()."""

    def __init__(self, allowed_networks: tuple = ()):
        self.resolver = aiohttp.ThreadedResolver()
        self.allowed_networks = allowed_networks

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list:
        results = await self.resolver.resolve(host, port, family)
        for result in results:
            if not fetchable(ipaddress.ip_address(result["host"]), self.allowed_networks):
                raise UnfetchableAddress(f"{host} resolves to {result['host']}, not a public address")
        return results

    async def close(self) -> None:
        await self.resolver.close()


class VisionPrompt:
    """The served model's way of reading images (its processor's files in the model directory): the marker a chat
    template writes for an image, the text the processor puts in its place (the soft-token placeholders), and the
    image processor that resizes and normalises. Used on encoding threads; max_pixels bounds a decoded image."""

    def __init__(self, image_processor, marker: str, max_pixels: int, sequence: str | None = None,
                 options: dict | None = None):
        """sequence: what every image's marker expands to (Gemma 3's run of soft tokens); None: the marker itself
        once per merged patch of the image's grid (Qwen2.5-VL's pad token). options: the image processor's."""
        if getattr(image_processor, "do_pan_and_scan", None):
            raise ValueError("the model's preprocessor_config.json enables pan and scan (do_pan_and_scan), which this "
                             "server does not serve: set it to false")
        self.image_processor, self.marker, self.max_pixels = image_processor, marker, max_pixels
        self.sequence, self.options = sequence, options or {}

    def expansion(self, image: PromptImage) -> str:
        """What the processor writes in place of this image's marker."""
        if self.sequence is not None:
            return self.sequence
        return self.marker * (math.prod(image.grid) // self.image_processor.merge_size ** 2)

    @classmethod
    def load(cls, model_dir: str, max_pixels: int) -> "VisionPrompt | None":
        """None, logged, when the model directory's processor cannot prepare images: its text is served alone.
        A Qwen2-VL image processor (its merge_size: an image is its pad token once per merged patch) serves alone:
        Qwen2.5-VL's whole processor also builds a video processor, which needs torchvision."""
        from transformers import AutoImageProcessor, AutoProcessor

        try:
            image_processor = AutoImageProcessor.from_pretrained(model_dir)
            if hasattr(image_processor, "merge_size"):
                return cls(image_processor, QWEN_IMAGE_PAD, max_pixels)
            processor = AutoProcessor.from_pretrained(model_dir)
            return cls(processor.image_processor, processor.boi_token, max_pixels, processor.full_image_sequence,
                       {"do_pan_and_scan": False})
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("images are refused: the model's processor (processor_config.json, "
                        "preprocessor_config.json) cannot prepare them: %s", exc)
            return None

    def expand(self, prompt: str, images: list[PromptImage]) -> str:
        """The rendered prompt with each image marker replaced by the processor's expansion of its image; the
        template must have written one marker per image."""
        pieces = prompt.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise RequestError(f"messages: the chat template wrote {len(pieces) - 1} image markers ({self.marker}) "
                               f"for {len(images)} images; each image part needs its own", param="messages")
        return pieces[0] + "".join(self.expansion(image) + piece for image, piece in zip(images, pieces[1:]))

    def prepare(self, source: ImageSource) -> PromptImage:
        """Decodes an image part and preprocesses it as the model's processor does (RGB, no pan and scan): Gemma 3's
        pixels [C, H, W], or Qwen2.5-VL's flattened patches with their grid."""
        encoded = base64_bytes(source) if isinstance(source.data, str) else source.data
        image = self.decode(encoded, source.where)
        processed = self.image_processor(images=[image], do_convert_rgb=True, return_tensors="pt", **self.options)
        grids = processed.get("image_grid_thw")
        if grids is None:
            return PromptImage.of_pixels(processed["pixel_values"][0].float())
        return PromptImage.of_pixels(processed["pixel_values"].float(), tuple(grids[0].tolist()))

    def decode(self, encoded: bytes, where: str) -> Image.Image:
        try:
            image = Image.open(io.BytesIO(encoded))
            if image.width * image.height > self.max_pixels:
                raise RequestError(f"{where}: the image is {image.width}x{image.height} pixels, more than "
                                   f"HFENDPOINT_IMAGE_MAX_PIXELS={self.max_pixels}", param="messages")
            image.load()
        except RequestError:
            raise
        except Image.DecompressionBombError:
            raise RequestError(f"{where}: the image has more pixels than HFENDPOINT_IMAGE_MAX_PIXELS="
                               f"{self.max_pixels}", param="messages") from None
        except Exception as exc:  # Pillow raises many kinds for data that is not an image it can read
            raise RequestError(f"{where}: not an image this server can read (PNG, JPEG, WebP, GIF, ...): {exc}",
                               param="messages") from exc
        return image


def base64_bytes(source: ImageSource) -> bytes:
    try:
        return base64.b64decode(source.data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{source.where}: the data URL's data is not valid base64", param="messages") from None
