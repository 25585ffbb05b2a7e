"""Which webhook URLs a gateway may POST to (the SSRF guard).

A gateway sits inside the operator's network, so a client-chosen URL must not make it
reach what the client cannot: loopback, private networks, link-local (cloud metadata at
169.254.169.254 and fd00:ec2::254), multicast, reserved and unspecified addresses, and the
same behind IPv6 wrappers (IPv4-mapped, 6to4, Teredo, NAT64). A URL is accepted only when it
is http(s), names a host, carries no credentials, and every address its host resolves to is
public, unless `BatchConfig.webhook_allow` names the host or a CIDR holding the address.

The check runs twice: when the request is accepted (a 400 with the reason), and at delivery
on the addresses resolved then, which are the only ones connected to (the Host header and
TLS SNI keep the original name), so a name that re-resolves to a private address later (DNS
rebinding) reaches nothing. Resolution is injected: the rules here are pure.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL_CHARS = 2048
DEFAULT_PORTS = {"http": 80, "https": 443}
# Where clouds serve instance credentials: refused even when a CIDR around them is allowed;
# only an allow-list entry naming exactly this address (or the host) opens it.
METADATA = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254"))
NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Names that are loopback by definition (RFC 6761), whatever a resolver says.
_LOCAL_NAMES = re.compile(r"(^|\.)localhost$|^localhost\.localdomain$")
# Characters parsers disagree on (the check and the connection must read the same host).
_AMBIGUOUS = re.compile(r"[\s\\\x00-\x1f\x7f]")

# host, port -> the addresses it resolves to (strings); raises OSError when it does not
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class Refused(ValueError):
    """The URL may not be a webhook target; the message says why (shown to the client)."""


@dataclass(frozen=True)
class WebhookUrl:
    """A syntactically acceptable webhook URL, split into what a connection needs."""

    url: str
    scheme: str  # "http" | "https"
    host: str  # lowercased, no trailing dot, no brackets (an IP literal in canonical form)
    port: int
    target: str  # path and query, as sent in the request line
    literal: IPAddress | None  # the host was an IP address (in any form inet_aton accepts)

    @property
    def host_header(self) -> str:
        name = f"[{self.host}]" if isinstance(self.literal, ipaddress.IPv6Address) else self.host
        return name if self.port == DEFAULT_PORTS[self.scheme] else f"{name}:{self.port}"

    def url_for(self, address: IPAddress) -> str:
        """The URL that connects to `address` itself (the Host header carries the name)."""
        host = f"[{address}]" if isinstance(address, ipaddress.IPv6Address) else str(address)
        return f"{self.scheme}://{host}:{self.port}{self.target}"


@dataclass(frozen=True)
class Vetted:
    """A webhook URL and the addresses it may be delivered to (connect to these only)."""

    url: WebhookUrl
    addresses: tuple[IPAddress, ...]


@dataclass(frozen=True)
class AllowList:
    hosts: frozenset[str]
    networks: tuple[IPNetwork, ...]

    @classmethod
    def parse(cls, entries: Sequence[str]) -> AllowList:
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in entries:
            text = entry.strip()
            if not text:
                continue
            try:
                networks.append(ipaddress.ip_network(text.strip("[]"), strict=False))
            except ValueError:
                hosts.add(_normal_name(text))
        return cls(frozenset(hosts), tuple(networks))

    def allows_host(self, host: str) -> bool:
        return host in self.hosts

    def allows_address(self, address: IPAddress) -> bool:
        if is_metadata(address):  # only an entry that is this very address
            return any(n.num_addresses == 1 and address in n for n in self.networks)
        return any(address in n for n in self.networks)


def _normal_name(host: str) -> str:
    return host.strip().lower().rstrip(".")


def _inet_aton(text: str) -> ipaddress.IPv4Address | None:
    """An IPv4 address in any form the C resolver accepts ("2130706433", "0177.0.0.1",
    "0x7f.1", "127.1"), so such a host is judged as the address it is; None otherwise."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values: list[int] = []
    for part in parts:
        try:
            if part[:2] in ("0x", "0X"):
                value = int(part[2:], 16) if part[2:] else 0
            elif len(part) > 1 and part[0] == "0":
                value = int(part[1:], 8)
            else:
                value = int(part, 10) if part.isdigit() else -1
        except ValueError:
            return None
        if value < 0:
            return None
        values.append(value)
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (5 - len(values))):
        return None
    number = 0
    for v in head:
        number = number << 8 | v
    number = number << (8 * (4 - len(head))) | last
    return ipaddress.IPv4Address(number)


def parse_url(url: str) -> WebhookUrl:
    """The URL's parts, or `Refused` when it is no acceptable http(s) URL."""
    if not isinstance(url, str) or not url:
        raise Refused("webhook_url must be a non-empty string")
    if len(url) > MAX_URL_CHARS:
        raise Refused(f"webhook_url is longer than {MAX_URL_CHARS} characters")
    if _AMBIGUOUS.search(url):
        raise Refused("webhook_url must not contain whitespace, backslashes or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise Refused(f"webhook_url is not a valid URL ({err})") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise Refused("webhook_url must be an http:// or https:// URL")
    if "@" in parts.netloc:
        raise Refused("webhook_url must not contain credentials (user@ or user:password@)")
    raw_host = parts.hostname or ""
    if not raw_host:
        raise Refused("webhook_url must name a host")
    if "%" in raw_host:
        raise Refused("webhook_url host must not be percent-encoded or carry an IPv6 zone")
    if port == 0:
        raise Refused("webhook_url port must be between 1 and 65535")
    host, literal = _host(raw_host, bracketed=parts.netloc.split(":")[0].startswith("["))
    target = parts.path or "/"
    if parts.query:
        target += f"?{parts.query}"
    return WebhookUrl(url, scheme, host, port or DEFAULT_PORTS[scheme], target, literal)


def _host(raw_host: str, *, bracketed: bool) -> tuple[str, IPAddress | None]:
    """The host in canonical form, and the address when it is an IP literal."""
    literal: IPAddress | None
    if bracketed:  # an IPv6 literal
        try:
            literal = ipaddress.IPv6Address(raw_host)
        except ValueError:
            raise Refused("webhook_url host is not a valid IPv6 address") from None
        return str(literal), literal
    host = _normal_name(raw_host)
    if not host or ".." in host:
        raise Refused("webhook_url must name a host")
    try:
        host.encode("ascii")
    except UnicodeEncodeError:
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise Refused("webhook_url host is not a valid domain name") from None
    literal = _inet_aton(host)
    return (str(literal), literal) if literal is not None else (host, None)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (mapped, 6to4, Teredo client, NAT64)."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_metadata(address: IPAddress) -> bool:
    """A cloud metadata address, or an IPv6 wrapper of one."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None and inner in METADATA:
            return True
    return address in METADATA


def address_refusal(address: IPAddress) -> str | None:
    """Why `address` is no public destination (None: it is)."""
    if address in METADATA:
        return "a cloud metadata address"
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None:
            why = address_refusal(inner)
            return f"an IPv6 wrapper of {inner}, {why}" if why else None
    for test, what in (
        (address.is_unspecified, "an unspecified address"),
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private address"),
    ):
        if test:
            return what
    if not address.is_global:
        return "not a public address"
    return None


def vet(url: WebhookUrl, addresses: Sequence[str | IPAddress], allow: AllowList) -> Vetted:
    """`url` with the addresses its host resolved to, or `Refused` when any of them may
    not be reached (one bad answer refuses the name: a rebinding resolver alternates)."""
    if url.literal is not None:
        resolved: list[IPAddress] = [url.literal]
    else:
        resolved = []
        for a in addresses:
            try:
                resolved.append(a if not isinstance(a, str) else ipaddress.ip_address(a.split("%")[0]))
            except ValueError:
                raise Refused(f"webhook_url host '{url.host}' resolved to an invalid address {a!r}") from None
        if not resolved:
            raise Refused(f"webhook_url host '{url.host}' does not resolve")
    if allow.allows_host(url.host):  # every address it resolves to, but cloud metadata
        for address in resolved:
            if is_metadata(address) and not allow.allows_address(address):
                raise Refused(
                    f"webhook_url host '{url.host}' resolves to {address}, a cloud metadata address{_HINT}"
                )
        return Vetted(url, tuple(dict.fromkeys(resolved)))
    if url.literal is None and _LOCAL_NAMES.search(url.host):
        # loopback by definition: only addresses the allow list names may be reached
        if not all(allow.allows_address(a) for a in resolved):
            raise Refused(f"webhook_url host '{url.host}' is a loopback name{_HINT}")
    for address in resolved:
        why = address_refusal(address)
        if why is not None and not allow.allows_address(address):
            where = (
                f"host '{url.host}' resolves to {address}" if url.literal is None else f"address {address}"
            )
            raise Refused(f"webhook_url {where}, {why}{_HINT}")
    return Vetted(url, tuple(dict.fromkeys(resolved)))


_HINT = "; the operator may allow it with batch.webhook_allow (a host or CIDR)"


async def check(url: str, allow: AllowList, resolve: Resolver) -> Vetted:
    """Parse, resolve and vet `url` (at acceptance and again before each delivery)."""
    parsed = parse_url(url)
    if parsed.literal is not None:
        return vet(parsed, (), allow)
    try:
        addresses = await resolve(parsed.host, parsed.port)
    except OSError as err:
        raise Refused(f"webhook_url host '{parsed.host}' does not resolve ({err})") from None
    return vet(parsed, addresses, allow)
