"""The SSRF guard on webhook URLs: tables of what is refused and why."""

from __future__ import annotations

import ipaddress
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet_base.batch.webhook_target import (
    AllowList,
    Refused,
    address_refusal,
    check,
    parse_url,
    vet,
)

NONE = AllowList.parse([])

# url, resolver answer, allow list, refusal fragment (None: accepted)
TABLE: list[tuple[str, list[str], list[str], str | None]] = [
    ("https://hooks.example.com/in?x=1", ["93.184.216.34"], [], None),
    ("http://hooks.example.com:8080/in", ["2606:2800:220:1:248:1893:25c8:1946"], [], None),
    ("https://8.8.8.8/hook", [], [], None),
    # schemes, hosts, credentials
    ("ftp://hooks.example.com/", ["93.184.216.34"], [], "http:// or https://"),
    ("file:///etc/passwd", [], [], "http:// or https://"),
    ("javascript:alert(1)", [], [], "http:// or https://"),
    ("http:///path", [], [], "name a host"),
    ("https://user@hooks.example.com/", ["93.184.216.34"], [], "credentials"),
    ("https://user:pw@hooks.example.com/", ["93.184.216.34"], [], "credentials"),
    ("http://127.0.0.1:80@hooks.example.com/", ["93.184.216.34"], [], "credentials"),
    ("http://hooks.example.com\\@127.0.0.1/", [], [], "backslashes"),
    ("http://hooks.example.com /", [], [], "whitespace"),
    ("http://hooks.example.com:0/", [], [], "port"),
    ("http://hooks.example.com:99999/", [], [], "not a valid URL"),
    # loopback in every spelling
    ("http://127.0.0.1/", [], [], "loopback"),
    ("http://127.1/", [], [], "loopback"),
    ("http://2130706433/", [], [], "loopback"),
    ("http://0x7f000001/", [], [], "loopback"),
    ("http://0177.0.0.1/", [], [], "loopback"),
    ("http://0x7f.0.0.1/", [], [], "loopback"),
    ("http://[::1]/", [], [], "loopback"),
    ("http://[::ffff:127.0.0.1]/", [], [], "loopback"),
    ("http://[::ffff:7f00:1]/", [], [], "loopback"),
    ("http://localhost/", ["127.0.0.1"], [], "loopback"),
    ("http://localhost./", ["127.0.0.1"], [], "loopback"),
    ("http://LOCALHOST:9000/", ["127.0.0.1"], [], "loopback"),
    ("http://app.localhost/", ["203.0.113.9"], [], "loopback name"),
    ("http://0.0.0.0/", [], [], "unspecified"),
    ("http://0/", [], [], "unspecified"),
    ("http://[::]/", [], [], "unspecified"),
    # private, link-local, metadata, multicast, reserved, shared
    ("http://10.0.0.5/", [], [], "private"),
    ("http://172.16.3.4/", [], [], "private"),
    ("http://192.168.1.1/", [], [], "private"),
    ("http://[fc00::1]/", [], [], "private"),
    ("http://169.254.169.254/latest/meta-data/", [], [], "metadata"),
    ("http://[fd00:ec2::254]/", [], [], "metadata"),
    ("http://2852039166/", [], [], "metadata"),  # 169.254.169.254 in decimal
    ("http://169.254.1.1/", [], [], "link-local"),
    ("http://[fe80::1]/", [], [], "link-local"),
    ("http://224.0.0.1/", [], [], "multicast"),
    ("http://[ff02::1]/", [], [], "multicast"),
    ("http://240.0.0.1/", [], [], "reserved"),
    ("http://100.64.0.1/", [], [], "public"),
    ("http://[::ffff:10.0.0.1]/", [], [], "private"),
    ("http://[2002:a00:1::]/", [], [], "10.0.0.1"),  # 6to4 of 10.0.0.1
    ("http://[64:ff9b::7f00:1]/", [], [], "127.0.0.1"),  # NAT64 of loopback
    # names resolving where they may not go (one bad answer refuses the name)
    ("https://rebind.example.com/", ["93.184.216.34", "10.1.2.3"], [], "resolves to 10.1.2.3"),
    ("https://metadata.google.internal/", ["169.254.169.254"], [], "metadata"),
    ("https://v6.example.com/", ["::ffff:192.168.0.1"], [], "private"),
    ("https://nowhere.example.com/", [], [], "does not resolve"),
    # the allow list: a host, or a CIDR holding every address
    ("http://127.0.0.1:8080/hook", [], ["127.0.0.1"], None),
    ("http://127.0.0.1:8080/hook", [], ["127.0.0.0/8"], None),
    ("http://localhost:8080/hook", ["127.0.0.1"], ["127.0.0.1/32"], None),
    ("http://localhost:8080/hook", ["127.0.0.1", "::1"], ["127.0.0.1/32"], "loopback name"),
    ("http://receiver.internal/", ["10.0.0.7"], ["receiver.internal"], None),
    ("http://Receiver.Internal./", ["10.0.0.7"], ["receiver.internal"], None),
    ("http://other.internal/", ["10.0.0.8"], ["receiver.internal"], "private"),
    ("http://receiver.internal/", ["10.0.0.7", "10.9.0.1"], ["10.0.0.0/24"], "10.9.0.1"),
    ("http://[::1]:9000/", [], ["::1"], None),
    # metadata stays closed behind a broad CIDR; only its exact address opens it
    ("http://169.254.169.254/", [], ["169.254.0.0/16"], "metadata"),
    ("http://169.254.169.254/", [], ["0.0.0.0/0"], "metadata"),
    ("http://169.254.169.254/", [], ["169.254.169.254"], None),
    ("http://receiver.internal/", ["169.254.169.254"], ["receiver.internal"], "metadata"),
    ("http://receiver.internal/", ["::ffff:169.254.169.254"], ["receiver.internal"], "metadata"),
    ("http://[::ffff:169.254.169.254]/", [], ["::/0"], "metadata"),
    ("http://receiver.internal/", ["169.254.169.254"], ["receiver.internal", "169.254.169.254"], None),
]


@pytest.mark.parametrize(("url", "answer", "allow", "refusal"), TABLE)
async def test_webhook_targets(url: str, answer: list[str], allow: list[str], refusal: str | None) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        if not answer:
            raise OSError("Name or service not known")
        return answer

    if refusal is None:
        vetted = await check(url, AllowList.parse(allow), resolve)
        assert vetted.addresses
    else:
        with pytest.raises(Refused, match=re.escape(refusal)):
            await check(url, AllowList.parse(allow), resolve)


async def test_ip_literals_are_never_resolved() -> None:
    async def resolve(host: str, port: int) -> list[str]:
        raise AssertionError("an IP literal must not be looked up")

    vetted = await check("http://2130706433:8080/x", AllowList.parse(["127.0.0.1"]), resolve)
    assert vetted.addresses == (ipaddress.ip_address("127.0.0.1"),)


@pytest.mark.parametrize(
    ("url", "host", "port", "target", "host_header", "connect"),
    [
        ("https://Hooks.Example.com/a/b?c=1#frag", "hooks.example.com", 443, "/a/b?c=1", "hooks.example.com", "https://93.184.216.34:443/a/b?c=1"),
        ("http://hooks.example.com:8080", "hooks.example.com", 8080, "/", "hooks.example.com:8080", "http://93.184.216.34:8080/"),
        ("http://[2001:db8::1]:9000/h", "2001:db8::1", 9000, "/h", "[2001:db8::1]:9000", "http://[2001:db8::1]:9000/h"),
        ("http://bücher.example/", "xn--bcher-kva.example", 80, "/", "xn--bcher-kva.example", "http://93.184.216.34:80/"),
    ],
)  # fmt: skip
def test_parsed_parts(url: str, host: str, port: int, target: str, host_header: str, connect: str) -> None:
    parsed = parse_url(url)
    assert (parsed.host, parsed.port, parsed.target, parsed.host_header) == (host, port, target, host_header)
    address = parsed.literal or ipaddress.ip_address("93.184.216.34")
    assert parsed.url_for(address) == connect


@given(st.ip_addresses())
def test_every_address_is_judged_with_its_ipv4_self(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> None:
    """An IPv6 wrapper of an IPv4 address is refused exactly when the address is."""
    if isinstance(address, ipaddress.IPv4Address):
        mapped = ipaddress.IPv6Address(f"::ffff:{address}")
        assert (address_refusal(mapped) is None) == (address_refusal(address) is None)
    elif address_refusal(address) is None:
        assert address.is_global


def test_vet_keeps_each_address_once() -> None:
    vetted = vet(parse_url("https://a.example.com/"), ["93.184.216.34", "93.184.216.34"], NONE)
    assert len(vetted.addresses) == 1
