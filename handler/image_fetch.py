"""Fetching a chat request's image parts: data URLs checked and kept, http(s) URLs fetched on the handler's event
loop (aiohttp) within the operator's limits (handler/settings.py): bytes per image, seconds per fetch, images per
request. A URL whose host is, or resolves to, a loopback, private, link-local or otherwise non-public address is
refused unless the operator allows its network, at every redirect too: the connection resolves through a resolver
that checks every address it returns, so the address checked is the address connected to. Every refusal is a 400
naming the part, `messages[i].content[j].image_url`.

Only a model that reads images fetches them: the handler imports this module (and aiohttp) for such a model alone.
"""

import asyncio
import ipaddress
import socket

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from daemon_protocol import RequestError
from handler.images import ImageSource, image_urls

MAX_REDIRECTS = 5
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
READ_CHUNK_BYTES = 1 << 16
ALLOWED_NETWORKS_VARIABLE = "HFENDPOINT_IMAGE_URL_ALLOWED_NETWORKS"


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
