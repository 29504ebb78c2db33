"""Where a pull may reach: the registries the configuration names, and otherwise only
public https addresses.

A pull names its source (a URL, a registry host, a Hugging Face repository), so a client
could make the daemon fetch from its own network: a loopback admin page, a cloud
metadata address, a printer. Every URL a pull opens, the first and each redirect, is
checked: origins configured in `[registry]` are trusted as the administrator wrote them;
any other must use https (plain http only with the request's `insecure`, as Ollama's
API defines it) and resolve to public addresses only (private, loopback, link-local,
multicast and reserved ones only with `registry.private_networks`).
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from barrel.errors import Forbidden, InvalidRequest

Origin = tuple[str, str, int]
_PORTS = {"http": 80, "https": 443}


def origin_of(url: str) -> Origin | None:
    p = urllib.parse.urlsplit(url)
    if p.scheme not in _PORTS or not p.hostname:
        return None
    try:
        port = p.port or _PORTS[p.scheme]
    except ValueError:
        return None
    return p.scheme, p.hostname.lower(), port


class PrivateAddress(Forbidden):
    code = "private_address"


@dataclass(frozen=True)
class NetPolicy:
    trusted: frozenset[Origin] = frozenset()
    private_networks: bool = False
    insecure: bool = False

    @classmethod
    def trusting(cls, bases: Iterable[str], **kw: bool) -> NetPolicy:
        return cls(frozenset(o for b in bases if (o := origin_of(b)) is not None), **kw)

    def check(self, url: str) -> None:
        """Raise unless a pull may open `url` (before connecting, and for redirects)."""
        origin = origin_of(url)
        if origin is None:
            raise InvalidRequest("a pull may only use http(s) URLs")
        if origin in self.trusted:
            return
        scheme, host, port = origin
        if scheme == "http" and not self.insecure:
            raise InvalidRequest(
                f"{host} would be reached over plain http; allow it with "
                '"insecure": true (ollama pull --insecure)'
            )
        if self.private_networks:
            return
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise InvalidRequest(f"{host} could not be resolved") from None
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            if not address.is_global or address.is_multicast:
                raise PrivateAddress(
                    f"{host} is on a private network; pulls reach only public addresses "
                    "unless registry.private_networks is set"
                )
