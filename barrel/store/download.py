"""Resumable HTTP downloads into a partial file (blocking: run it in a worker thread).

A download appends to its partial file chunk by chunk; started again (after a daemon
restart, say) it hashes what is already there and asks for the rest with `Range`. A
server that ignores the range (200) restarts it from zero. The digest is checked at the
end: a mismatch deletes the partial.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from barrel.errors import BarrelError, InvalidRequest
from barrel.store.blobs import DigestMismatch, hash_file
from barrel.store.names import parse_digest
from barrel.store.netpolicy import NetPolicy
from barrel.store.netpolicy import origin_of as url_origin

logger = logging.getLogger(__name__)

CHUNK = 1 << 20
USER_AGENT = "barrel-inference"


class DownloadError(BarrelError):
    status = 502
    code = "download_failed"

    def __init__(self, message: str, *, http_status: int | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status


class Cancelled(BarrelError):
    status = 499
    code = "cancelled"


Progress = Callable[[int, int | None], None]  # (completed, total)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Every redirect target passes the pull's network policy too."""

    def __init__(self, policy: NetPolicy) -> None:
        self.policy = policy

    def redirect_request(
        self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> Any:
        self.policy.check(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def open_url(
    url: str,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    policy: NetPolicy | None = None,
) -> object:
    """GET `url`. With a `policy` (a pull's), the URL and every redirect are checked
    first, and a failure to connect says nothing of the port (open, closed, filtered)."""
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **(headers or {})})
    if policy is not None:
        policy.check(url)
        opener = urllib.request.build_opener(_CheckedRedirects(policy))
    else:
        opener = urllib.request.build_opener()
    try:
        return opener.open(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise DownloadError(
            f"GET {url}: HTTP {exc.code} {exc.reason}", http_status=exc.code
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, BarrelError):
            raise reason from None  # a redirect the policy refused
        if isinstance(reason, ssl.SSLError) and url.startswith("https://"):
            raise DownloadError(
                f"GET {url}: the server does not speak https; if it is a plain-http "
                'registry, pull with "insecure": true (ollama pull --insecure)'
            ) from None
        if policy is not None and url_origin(url) not in policy.trusted:
            raise DownloadError(f"GET {url}: the server could not be reached") from None
        raise DownloadError(f"GET {url}: {reason}") from None


def fetch_bounded(url: str, max_bytes: int, policy: NetPolicy, timeout: float = 15.0) -> bytes:
    """GET a small resource whole (an image a request names): a 400 for anything the
    policy refuses, that fails, or that is larger than `max_bytes`."""
    refused = (
        f"{url}: image URLs must be public https addresses or origins listed in "
        "registry.image_origins"
    )
    try:
        policy.check(url)
    except BarrelError:
        raise InvalidRequest(refused) from None
    try:
        with open_url(url, timeout=timeout, policy=policy) as resp:  # type: ignore[attr-defined]
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                data = b""
            else:
                data = bytes(resp.read(max_bytes + 1))
    except DownloadError as exc:
        raise InvalidRequest(f"the image could not be fetched: {exc.message}") from None
    except BarrelError:  # a redirect the policy refused
        raise InvalidRequest(refused) from None
    except OSError as exc:
        raise InvalidRequest(f"the image could not be fetched: {url}: {exc}") from None
    if not data or len(data) > max_bytes:
        raise InvalidRequest(f"{url}: an image must have 1 to {max_bytes} bytes")
    return data


def fetch(
    url: str,
    partial: Path,
    *,
    digest: str | None,
    size: int | None,
    progress: Progress,
    cancelled: threading.Event,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    policy: NetPolicy | None = None,
) -> tuple[str, int]:
    """Download `url` into `partial`; returns (sha256 digest, size). The partial stays
    on failure (to resume) except on a digest mismatch."""
    have = partial.stat().st_size if partial.exists() else 0
    h = hashlib.sha256()
    if have:
        with partial.open("rb") as f:
            hash_file(f, h)
    if size is not None and have > size:
        partial.unlink()
        have, h = 0, hashlib.sha256()
    if size is None or have < size:
        req_headers = dict(headers or {})
        if have:
            req_headers["Range"] = f"bytes={have}-"
        resp = open_url(url, req_headers, timeout, policy)
        with resp as r:  # type: ignore[attr-defined]
            status = r.status
            if have and status == 200:
                logger.info("%s ignored the range request; restarting", url)
                have, h = 0, hashlib.sha256()
            total = size
            length = r.headers.get("Content-Length")
            if total is None and length is not None:
                total = have + int(length)
            progress(have, total)
            with partial.open("r+b" if have else "wb") as f:
                f.seek(have)
                f.truncate()
                while True:
                    if cancelled.is_set():
                        raise Cancelled("download cancelled")
                    block = r.read(CHUNK)
                    if not block:
                        break
                    f.write(block)
                    f.flush()  # what is flushed survives a crash: resume loses < 1 chunk
                    h.update(block)
                    have += len(block)
                    progress(have, total)
    if size is not None and have != size:
        raise DownloadError(f"{url}: got {have} bytes, expected {size}")
    actual = "sha256:" + h.hexdigest()
    if digest is not None and parse_digest(digest) != h.hexdigest():
        partial.unlink(missing_ok=True)
        raise DigestMismatch(f"{url}: downloaded data has digest {actual}, expected {digest}")
    return actual, have
