"""A typed asyncio client for Barrel's Ollama-style and management endpoints, on aiohttp.

    async with BarrelClient() as barrel:            # $BARREL_HOST, else 127.0.0.1:8080
        async for event in barrel.pull("qwen2.5:0.5b"):
            print(event.get("status"), event.get("completed"), event.get("total"))
        async for part in barrel.chat("qwen", [{"role": "user", "content": "Hi"}]):
            print(part["message"]["content"], end="")

Streams are async generators of the NDJSON objects the daemon sends. A daemon that
cannot be reached raises `DaemonUnreachable`; an error answer (or an `{"error": ...}`
line in a stream) raises `ApiError` with the daemon's message and status.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import aiohttp

DEFAULT_HOST = "http://127.0.0.1:8080"


def daemon_url(host: str | None = None) -> str:
    """`host`, else $BARREL_HOST, else the default; "host:port" gets http://."""
    url = host or os.environ.get("BARREL_HOST") or DEFAULT_HOST
    return (url if "://" in url else f"http://{url}").rstrip("/")


class DaemonUnreachable(Exception):
    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"cannot reach Barrel at {url} ({why})")
        self.url = url


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _message(body: Any, fallback: str) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", fallback))
    return str(err) if err else fallback


class BarrelClient:
    def __init__(
        self, host: str | None = None, *, timeout: float = 600.0, api_key: str | None = None
    ) -> None:
        self.url = daemon_url(host)
        key = api_key or os.environ.get("BARREL_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> BarrelClient:
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    # -- plumbing ------------------------------------------------------------------------

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            async with self._http().request(method, self.url + path, json=body) as resp:
                text = await resp.text()
                data = json.loads(text) if text.strip() else None
                if resp.status >= 400:
                    raise ApiError(resp.status, _message(data, resp.reason or str(resp.status)))
                return data
        except aiohttp.ClientConnectionError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None
        except json.JSONDecodeError:
            raise ApiError(502, f"{path} did not answer JSON") from None

    async def stream(self, path: str, body: Any) -> AsyncIterator[dict[str, Any]]:
        """POST `body`; yield each NDJSON object; an error line raises ApiError."""
        try:
            async with self._http().post(self.url + path, json=body) as resp:
                if resp.status >= 400:
                    text = await resp.text()
                    data = json.loads(text) if text.strip().startswith("{") else None
                    raise ApiError(resp.status, _message(data, text or str(resp.status)))
                async for raw in resp.content:
                    if not raw.strip():
                        continue
                    event = json.loads(raw)
                    if isinstance(event, dict) and "error" in event:
                        raise ApiError(int(event.get("status_code", 500)), _message(event, ""))
                    yield event
        except aiohttp.ClientConnectionError as exc:
            raise DaemonUnreachable(self.url, str(exc) or type(exc).__name__) from None

    # -- models --------------------------------------------------------------------------

    async def version(self) -> str:
        return str((await self.request("GET", "/api/version"))["version"])

    async def list_models(self) -> list[dict[str, Any]]:
        return list((await self.request("GET", "/api/tags"))["models"])

    async def ps(self) -> list[dict[str, Any]]:
        return list((await self.request("GET", "/api/ps"))["models"])

    async def show(self, model: str, *, verbose: bool = False) -> dict[str, Any]:
        return dict(await self.request("POST", "/api/show", {"model": model, "verbose": verbose}))

    async def delete(self, model: str) -> None:
        await self.request("DELETE", "/api/delete", {"model": model})

    async def copy(self, source: str, destination: str) -> None:
        await self.request("POST", "/api/copy", {"source": source, "destination": destination})

    async def edit(self, model: str, parameters: dict[str, Any]) -> None:
        await self.request("POST", "/api/edit", {"model": model, "parameters": parameters})

    def create(self, model: str, modelfile: str) -> AsyncIterator[dict[str, Any]]:
        return self.stream("/api/create", {"model": model, "modelfile": modelfile})

    def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[dict[str, Any]]:
        return self.stream("/api/pull", {"model": model, "insecure": insecure})

    async def search(self, query: str) -> list[dict[str, Any]]:
        return list((await self.request("POST", "/api/search", {"query": query}))["models"])

    async def prune(self) -> dict[str, Any]:
        return dict(await self.request("POST", "/api/prune", {}))

    async def status(self) -> dict[str, Any]:
        return dict(await self.request("GET", "/api/status"))

    # -- generation ----------------------------------------------------------------------

    def chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        *,
        options: dict[str, Any] | None = None,
        keep_alive: str | float | None = None,
        think: bool | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
        body.update(_optional(options=options, keep_alive=keep_alive, think=think))
        return self.stream("/api/chat", body)

    def generate(
        self,
        model: str,
        prompt: str,
        *,
        options: dict[str, Any] | None = None,
        system: str | None = None,
        keep_alive: str | float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": True}
        body.update(_optional(options=options, system=system, keep_alive=keep_alive))
        return self.stream("/api/generate", body)

    async def embed(self, model: str, inputs: list[str]) -> list[list[float]]:
        answer = await self.request("POST", "/api/embed", {"model": model, "input": inputs})
        return [list(v) for v in answer["embeddings"]]

    async def load(self, model: str, keep_alive: str | float | None = None) -> None:
        await self.request(
            "POST", "/api/generate", {"model": model, **_optional(keep_alive=keep_alive)}
        )

    async def unload(self, model: str) -> None:
        await self.request("POST", "/api/generate", {"model": model, "keep_alive": 0})


def _optional(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}
