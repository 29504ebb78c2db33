"""openapi.yaml is a valid OpenAPI 3.1 document; every operation carries an example
request and response that match their schemas; and replayed against a live daemon, in
the order the documented links lead (a blob, a pull, a create, its show, copy, edit and
delete; a stored response's get and delete), every example gets its documented status
and an answer that matches the schema: every NDJSON line and every SSE event, streamed
or not."""

from __future__ import annotations

import json
from typing import Any

import httpx
from openapi_spec_validator import validate

from tests.contract.live import MAX_TOKENS, Live
from tests.contract.spec import (
    Operation,
    ndjson,
    operation,
    operations,
    resolve,
    spec,
    sse_data,
    validator,
)
from tests.sounds import tone_wav

# The stateful flows first, in the order their links lead (the example blob is not a GGUF:
# its link to create is left to the fuzzer's stateful phase); prune last (it removes the
# uploaded blob). The rest in the document's order.
FIRST = ["pull", "create", "show", "copy", "edit", "delete", "uploadBlob", "blobExists"]
FLOWS = ["createResponse", "getResponse", "deleteResponse", "listModels", "getModel"]
LAST = ["prune"]
STREAMED = ["chat", "generate", "pull", "create", "createChatCompletion", "createCompletion"]
STREAMED += ["createResponse", "createMessage"]


def test_openapi_yaml_is_a_valid_openapi_3_1_document() -> None:
    validate(spec())
    assert spec()["openapi"] == "3.1.0"


def test_every_operation_has_an_example_request_and_response() -> None:
    for op in operations():
        if op.request is not None:
            assert op.request_example is not None, f"{op.id}: no request example"
        _, response = op.success()
        for media, content in response.get("content", {}).items():
            if media in ("application/json", "text/plain"):
                assert "example" in content, f"{op.id}: no {media} response example"


def _request_schema(op: Operation) -> tuple[str, ...]:
    body = op.body["requestBody"]
    where = (
        tuple(body["$ref"].removeprefix("#/").split("/"))
        if "$ref" in body
        else ("paths", op.path, op.method, "requestBody")
    )
    return (*where, "content", str(op.request_media), "schema")


def test_every_example_matches_its_schema() -> None:
    checked = 0
    for op in operations():
        if op.request is not None and op.request_media == "application/json":
            validator(*_request_schema(op)).validate(op.request_example)
            checked += 1
        for status in op.body["responses"]:
            for media, content in resolve(op.body["responses"][status]).get("content", {}).items():
                if "example" in content and media.endswith("json"):
                    where = (*op.where(str(status)), "content", media, "schema")
                    validator(*where).validate(content["example"])
                    checked += 1
    assert checked > 60


# -- replay ---------------------------------------------------------------------------


def _pointer(doc: Any, pointer: str) -> Any:
    for part in pointer.strip("/").split("/"):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _evaluate(expr: Any, request: dict[str, Any], response: Any) -> Any:
    """A link's runtime expression ($request.body#/..., $request.path.x,
    $response.body#/...), or a literal."""
    if isinstance(expr, dict):
        return {k: _evaluate(v, request, response) for k, v in expr.items()}
    if not isinstance(expr, str) or not expr.startswith("$"):
        return expr
    if expr.startswith("$request.body#"):
        return _pointer(request["body"], expr.split("#", 1)[1])
    if expr.startswith("$request.path."):
        return request["path"][expr.removeprefix("$request.path.")]
    if expr.startswith("$response.body#"):
        return _pointer(response, expr.split("#", 1)[1])
    raise AssertionError(f"unknown expression {expr}")


class Replay:
    def __init__(self, live: Live) -> None:
        self.client = httpx.Client(base_url=live.url, timeout=120)
        self.linked: dict[str, dict[str, Any]] = {}  # op id -> {"path": {...}, "body": {...}}
        self.followed: list[str] = []

    def send(self, op: Operation, stream: bool = False) -> httpx.Response:
        link = self.linked.get(op.id, {})
        path_params = {**op.path_examples, **link.get("path", {})}
        url = op.path.format(**path_params)
        example = op.request_example
        kwargs: dict[str, Any] = {}
        body: Any = None
        if op.request_media == "application/json":
            body = {**example, **link.get("body", {})}
            if stream:
                body["stream"] = True
            kwargs["json"] = body
        elif op.request_media == "multipart/form-data":  # an audio form: a real clip
            kwargs["data"] = {k: str(v) for k, v in example.items() if k != "file"}
            kwargs["files"] = {"file": ("clip.wav", tone_wav(0.5))}
        elif op.request_media is not None:
            kwargs["content"] = str(example).encode()
        response = self.client.request(op.method.upper(), url, **kwargs)
        if not stream:
            self._follow(op, {"body": body, "path": path_params}, response)
        return response

    def _follow(self, op: Operation, request: dict[str, Any], response: httpx.Response) -> None:
        _, documented = op.success()
        answer = response.json() if "json" in response.headers.get("content-type", "") else None
        for link in documented.get("links", {}).values():
            link = resolve(link)
            target = self.linked.setdefault(link["operationId"], {})
            if "parameters" in link:
                target["path"] = _evaluate(link["parameters"], request, answer)
            if "requestBody" in link:
                target["body"] = _evaluate(link["requestBody"], request, answer)
            self.followed.append(f"{op.id} -> {link['operationId']}")


def _check_answer(op: Operation, response: httpx.Response) -> int:
    """The answer matches the documented success; returns how many frames were checked."""
    status, documented = op.success()
    assert str(response.status_code) == status, f"{op.id}: {response.status_code} {response.text}"
    media = response.headers.get("content-type", "").split(";")[0]
    content = documented.get("content", {})
    if not content:
        return 0
    assert media in content, f"{op.id}: undocumented {media}"
    where = (*op.where(status), "content", media, "schema")
    if media == "application/json":
        validator(*where).validate(response.json())
        return 1
    if media == "application/x-ndjson":
        lines = ndjson(response.text)
        check = validator(*where)
        for line in lines:
            check.validate(line)
        return len(lines)
    if media == "text/event-stream":
        return _check_events(where, response.text)
    assert media == "text/plain"
    return 1


def _check_events(where: tuple[str, ...], text: str) -> int:
    """Each event against the event schema, and each data payload (but [DONE]) against
    the contentSchema of `data`."""
    events = sse_data(text)
    assert events
    node: Any = spec()
    for part in where:
        node = node[part]
    event_where = tuple(node["$ref"].removeprefix("#/").split("/"))
    data_where = (*event_where, "properties", "data")
    data = resolve({"$ref": "#/" + "/".join(data_where)})
    if "anyOf" in data:
        (i,) = [i for i, b in enumerate(data["anyOf"]) if "contentSchema" in b]
        data_where = (*data_where, "anyOf", str(i))
    envelope, frames = validator(*event_where), validator(*data_where, "contentSchema")
    for event, payload in events:
        envelope.validate({"event": event, "data": payload})
        if payload != "[DONE]":
            frames.validate(json.loads(payload))
    return len(events)


def test_every_example_is_served_as_documented(live: Live) -> None:
    replay = Replay(live)
    ids = [op.id for op in operations()]
    order = FIRST + FLOWS + [i for i in ids if i not in FIRST + FLOWS + LAST] + LAST
    assert sorted(order) == sorted(ids)
    frames = 0
    for op_id in order:
        frames += _check_answer(operation(op_id), replay.send(operation(op_id)))
    # the links were followed: the created model was shown, copied and deleted, the
    # stored response read back and forgotten
    for step in [
        "create -> show",
        "create -> copy",
        "copy -> delete",
        "createResponse -> getResponse",
    ]:
        assert step in replay.followed
    assert frames >= len(ids) - 6  # HEAD, 201 and empty 200s have no body


def test_streamed_examples_match_their_frame_schemas(live: Live) -> None:
    replay = Replay(live)
    for op_id in STREAMED:
        op = operation(op_id)
        with replay.client.stream(
            "POST", op.path, json={**op.request_example, "stream": True}
        ) as response:
            response.read()
        checked = _check_answer(op, response)
        assert checked >= 2, f"{op_id}: {checked} frames"


def test_the_configured_max_tokens_ends_every_answer(live: Live) -> None:
    """limits.max_tokens caps what a request asks for, what the model's defaults leave
    open, and a reasoning step, in every dialect (llama-server's --n-predict)."""
    asked = httpx.post(
        live.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100},
        timeout=120,
    ).json()
    assert asked["usage"]["completion_tokens"] == MAX_TOKENS
    assert asked["choices"][0]["finish_reason"] == "length"
    unbounded = httpx.post(
        live.url + "/api/generate",
        json={"model": "tiny", "prompt": "Hi", "raw": True, "stream": False},
        timeout=120,
    ).json()
    assert (unbounded["eval_count"], unbounded["done_reason"]) == (MAX_TOKENS, "length")
    below = httpx.post(
        live.url + "/v1/messages",
        json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=120,
    ).json()
    assert (below["usage"]["output_tokens"], below["stop_reason"]) == (3, "max_tokens")
