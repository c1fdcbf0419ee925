"""Images in chat requests: OpenAI's `image_url` content parts -> the engine's PromptImage (pixels the model's own
image processor prepared), and the prompt's image markers expanded as the model's processor expands them.

A part's URL is a `data:` URL (base64 PNG, JPEG, WebP or anything else Pillow reads) or an http(s) URL the handler
fetches on its event loop (handler/image_fetch.py).
The processor's files say what an image's marker in the rendered prompt expands to: Gemma 3's fixed run of soft
tokens, or Qwen2.5-VL's image pad token once per merged patch of the grid its image processor resized the image to
(within its min and max pixels: dynamic resolution).
Decoding and preprocessing (Pillow, the processor's resize and normalisation) run on an encoding thread
(handler/service.py), never on the event loop or the engine thread. Every refusal is a 400 naming the part,
`messages[i].content[j].image_url`.
"""

import base64
import binascii
import io
import logging
import math
from dataclasses import dataclass

from PIL import Image

from daemon_protocol import RequestError
from engine.images import PromptImage

IMAGE_PART_TYPE = "image_url"
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
