"""Images in: the tiny model with a synthetic projector (barrel.store.synthetic), through
each dialect's official SDK. The image's tokens are in the usage, a second turn about the
same image reuses its KV cells, a model without a projector is the dialect's 400, and a
projector comes from the config, a Modelfile's second FROM, an Ollama registry layer or a
Hugging Face repository's mmproj file."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import LlamaModel
from barrel.engine.projector import is_placeholder
from barrel.engine.types import GREEDY, EngineRequest
from barrel.store.synthetic import (
    ProjectorShape,
    TinyShape,
    tiny_projector,
    write_tiny_projector,
)
from tests.daemon import Daemon, serve_models
from tests.images import BLUE, RED, data_url, solid_png
from tests.registry_server import RegistryServer

# 24x24 images are resized to the projector's 32x32 and cut in 8x8 patches
IMAGE_TOKENS = (ProjectorShape().image_size // ProjectorShape().patch_size) ** 2


@pytest.fixture(scope="module")
def projector() -> Path:
    return tiny_projector()


# -- the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path)
    yield m
    m.free()


def _by_digest(*blobs: bytes) -> dict[str, bytes]:
    return {hashlib.sha256(b).hexdigest(): b for b in blobs}


def _prompt(model: LlamaModel, tokens: list[int], text: str) -> list[int]:
    head = model.tokenize("<|im_start|>user\n")
    tail = model.tokenize(f"{text}<|im_end|>\n<|im_start|>assistant\n", add_special=False)
    return [*head, *tokens, *tail]


async def test_the_engine_reads_an_image_and_reuses_its_cells(
    model: LlamaModel, projector: Path
) -> None:
    e = Engine(model, EngineOptions(n_ctx=512, n_seq_max=2, mmproj=projector)).start()
    try:
        assert e.projector is not None
        red, blue = e.projector.read(_by_digest(RED, BLUE)).values()
        assert red.media[0].n_pos == IMAGE_TOKENS
        assert red.media[0].token != blue.media[0].token

        async def answer(piece: object, text: str = "What is it?") -> tuple[int, ...]:
            prompt = _prompt(model, piece.tokens(), text)  # type: ignore[attr-defined]
            media = piece.media  # type: ignore[attr-defined]
            request = EngineRequest(prompt, GREEDY, max_tokens=8, media=media)
            _, done = await e.submit(request).collect()
            assert done.usage.prompt_tokens == len(prompt)
            return done.tokens

        # the image changes the answer, and the same image gives the same answer
        first = await answer(red)
        assert await answer(blue) != first
        assert await answer(red) == first
        # a follow-up turn: everything up to the new text comes from the KV cache
        prompt = _prompt(model, red.tokens(), "What is it?")
        history = [*prompt, *first]
        follow = [
            *history,
            *model.tokenize("<|im_end|>\n<|im_start|>user\nAnd?", add_special=False),
        ]
        request = EngineRequest(follow, GREEDY, max_tokens=4, media=red.media)
        _, done = await e.submit(request).collect()
        assert done.usage.prompt_reused >= len(prompt)
        assert all(not is_placeholder(t) for t in done.tokens)
    finally:
        await asyncio.to_thread(e.stop)


async def test_the_engine_refuses_what_it_cannot_read(model: LlamaModel, projector: Path) -> None:
    from barrel.errors import InvalidRequest

    plain = Engine(model, EngineOptions(n_ctx=256, n_seq_max=1)).start()
    seeing = Engine(model, EngineOptions(n_ctx=256, n_seq_max=1, mmproj=projector)).start()
    try:
        assert seeing.projector is not None
        [piece] = seeing.projector.read(_by_digest(RED)).values()
        prompt = _prompt(model, piece.tokens(), "Hi")
        with pytest.raises(InvalidRequest, match="text only"):
            plain.submit(EngineRequest(prompt, GREEDY, media=piece.media))
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            seeing.submit(EngineRequest(prompt, GREEDY))  # placeholders of no image
        with pytest.raises(InvalidRequest, match="end with an image"):
            seeing.submit(EngineRequest(piece.tokens(), GREEDY, media=piece.media))
        with pytest.raises(InvalidRequest, match="could not be decoded"):
            seeing.projector.read(_by_digest(b"GIF89a but not really an image"))
    finally:
        await asyncio.to_thread(plain.stop)
        await asyncio.to_thread(seeing.stop)


# -- the daemon ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    server = RegistryServer(tmp_path_factory.mktemp("vision-registry"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_path: Path,
    projector: Path,
    registry: RegistryServer,
) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("vision-daemon")
    config = (
        f'projectors = {{ "tiny-vision" = "{projector}" }}\n'
        f'[registry]\nhuggingface = "{registry.url}"\nimage_origins = ["{registry.url}"]\n'
        f'[registry.hosts]\n"registry.ollama.ai" = "{registry.url}"\n'
    )
    d = serve_models(tmp, {"tiny": tiny_path, "tiny-vision": tiny_path}, config=config)
    yield d
    d.kill()


def _openai(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _anthropic(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", timeout=120, max_retries=0)


def _ollama(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url, timeout=120)


def _reused(daemon: Daemon, model: str) -> float:
    text = httpx.get(daemon.url + "/metrics", timeout=30).text
    pattern = (
        r'^barrel_engine_prompt_tokens_total\{model="'
        + re.escape(model)
        + r'",source="reused"\} (\S+)$'
    )
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def test_show_lists_vision_only_with_a_projector(daemon: Daemon) -> None:
    client = _ollama(daemon)
    assert "vision" in (client.show("tiny-vision").capabilities or [])
    assert "vision" not in (client.show("tiny").capabilities or [])


def test_openai_chat_with_a_data_url_then_a_second_turn(daemon: Daemon) -> None:
    client = _openai(daemon)

    def ask(model: str, content: object, history: list[dict[str, object]] | None = None) -> object:
        messages = [*(history or []), {"role": "user", "content": content}]
        return client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=6,  # type: ignore[arg-type]
        )

    text_only = ask("tiny-vision", "What colour is this?")
    image = {"type": "image_url", "image_url": {"url": data_url(RED)}}
    question = [image, {"type": "text", "text": "What colour is this?"}]
    first = ask("tiny-vision", question)
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS  # type: ignore[attr-defined]
    blue = ask(
        "tiny-vision", [{"type": "image_url", "image_url": {"url": data_url(BLUE)}}, question[1]]
    )
    assert blue.choices[0].message.content != first.choices[0].message.content  # type: ignore[attr-defined]
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": first.choices[0].message.content},  # type: ignore[attr-defined]
    ]
    second = ask("tiny-vision", "And the shape?", history)
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[attr-defined]
    assert cached >= first.usage.prompt_tokens  # type: ignore[attr-defined]

    with pytest.raises(openai.BadRequestError) as refused:
        ask("tiny", question)
    assert "images are not supported" in refused.value.message
    assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_the_projector_counts_in_the_loaded_size(daemon: Daemon, projector: Path) -> None:
    client = _ollama(daemon)
    for name in ("tiny", "tiny-vision"):
        client.generate(name, "")  # an empty prompt loads the model
    loaded = {str(m.model).removesuffix(":latest"): m.size for m in client.ps().models}
    # the same weights under both names: the projector is the difference
    assert loaded["tiny-vision"] - loaded["tiny"] == projector.stat().st_size


def test_openai_responses_take_an_input_image(daemon: Daemon) -> None:
    client = _openai(daemon)
    parts = [
        {"type": "input_image", "image_url": data_url(RED)},
        {"type": "input_text", "text": "Describe it."},
    ]
    r = client.responses.create(
        model="tiny-vision",
        input=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        max_output_tokens=6,
        temperature=0,
    )
    plain = client.responses.create(
        model="tiny-vision", input="Describe it.", max_output_tokens=6, temperature=0
    )
    assert r.usage is not None
    assert plain.usage is not None
    assert r.usage.input_tokens == plain.usage.input_tokens + IMAGE_TOKENS
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=[{"role": "user", "content": parts}])  # type: ignore[list-item]


def test_anthropic_image_blocks_base64_and_url(daemon: Daemon, registry: RegistryServer) -> None:
    client = _anthropic(daemon)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()}
    question = [
        {"type": "image", "source": source},
        {"type": "text", "text": "What is in the picture?"},
    ]

    def ask(model: str, messages: list[dict[str, object]]) -> anthropic.types.Message:
        return client.messages.create(
            model=model,
            max_tokens=6,
            messages=messages,
            extra_body={"temperature": 0},  # type: ignore[arg-type]
        )

    first = ask("tiny-vision", [{"role": "user", "content": question}])
    plain = ask("tiny-vision", [{"role": "user", "content": "What is in the picture?"}])
    counted = client.messages.count_tokens(
        model="tiny-vision",
        messages=[{"role": "user", "content": question}],  # type: ignore[list-item]
    )
    alone = client.messages.count_tokens(
        model="tiny-vision", messages=[{"role": "user", "content": "What is in the picture?"}]
    )
    assert counted.input_tokens == alone.input_tokens + IMAGE_TOKENS
    assert first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) == (
        plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0) + IMAGE_TOKENS
    )
    answer = "".join(b.text for b in first.content if b.type == "text")
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer or "."},
        {"role": "user", "content": "Are you sure?"},
    ]
    second = ask("tiny-vision", history)
    first_prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert (second.usage.cache_read_input_tokens or 0) >= first_prompt

    # a URL source, fetched from an origin the configuration trusts
    path = registry.root / "blue.png"
    path.write_bytes(BLUE)
    registry.files["blue.png"] = path
    by_url = [
        {"type": "image", "source": {"type": "url", "url": f"{registry.url}/files/blue.png"}},
        {"type": "text", "text": "What is in the picture?"},
    ]
    fetched = ask("tiny-vision", [{"role": "user", "content": by_url}])
    inline = [{"type": "image", "source": {**source, "data": base64.b64encode(BLUE).decode()}}]
    same = ask("tiny-vision", [{"role": "user", "content": [*inline, by_url[1]]}])
    assert fetched.content == same.content
    with pytest.raises(anthropic.BadRequestError) as refused:
        ask("tiny", [{"role": "user", "content": question}])
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_ollama_images_on_chat_and_generate(daemon: Daemon) -> None:
    client = _ollama(daemon)
    options = {"temperature": 0, "num_predict": 6}
    text = client.chat(
        "tiny-vision", [{"role": "user", "content": "What is this?"}], options=options
    )
    message = {"role": "user", "content": "What is this?", "images": [RED]}
    first = client.chat("tiny-vision", [message], options=options)
    assert first.prompt_eval_count == (text.prompt_eval_count or 0) + IMAGE_TOKENS
    before = _reused(daemon, "tiny-vision")
    history = [message, first.message, {"role": "user", "content": "Really?"}]
    client.chat("tiny-vision", history, options=options)
    assert _reused(daemon, "tiny-vision") - before >= first.prompt_eval_count  # type: ignore[operator]

    generated = client.generate("tiny-vision", "What is this?", images=[BLUE], options=options)
    plain = client.generate("tiny-vision", "What is this?", options=options)
    assert generated.prompt_eval_count == (plain.prompt_eval_count or 0) + IMAGE_TOKENS

    with pytest.raises(ollama.ResponseError) as refused:
        client.chat("tiny", [message])
    assert refused.value.status_code == 400
    assert "images are not supported" in refused.value.error


def test_bad_images_are_a_400_before_any_work(daemon: Daemon, registry: RegistryServer) -> None:
    def chat(url: str) -> httpx.Response:
        body = {
            "model": "tiny-vision",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
            ],
            "max_tokens": 2,
        }
        return httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=60)

    broken = RED[:40]  # a PNG header, then nothing
    cases = {
        data_url(broken): "could not be decoded",
        data_url(b"plain text"): "must be PNG, JPEG, GIF or BMP",
        "data:image/png;base64,%%%": "not valid base64",
        "ftp://example.com/x.png": "data URL or an http(s) URL",
        # an origin the configuration does not trust: a private address
        "http://127.0.0.1:9/x.png": "registry.image_origins",
        "https://localhost:9/x.png": "registry.image_origins",
        f"{registry.url}/files/missing.png": "404",
    }
    for url, message in cases.items():
        r = chat(url)
        assert r.status_code == 400, (url, r.text)
        assert message in r.json()["error"]["message"], (url, r.text)
    # a decompression bomb: 2 KB of PNG declaring 400 million pixels, refused from its header
    bomb = solid_png((1, 2, 3), 20000, 1)
    bomb = bomb[:16] + (20000).to_bytes(4, "big") + (20000).to_bytes(4, "big") + bomb[24:]
    r = chat(data_url(bomb))
    assert r.status_code == 400, r.text
    assert "larger than" in r.json()["error"]["message"]
    webp = b"RIFF\x10\x00\x00\x00WEBPVP8 " + bytes(8)
    r = chat("data:image/webp;base64," + base64.b64encode(webp).decode())
    assert r.status_code == 400, r.text
    assert "WebP" in r.json()["error"]["message"]
    assert httpx.get(daemon.url + "/api/version", timeout=10).status_code == 200


def test_a_modelfile_second_from_adds_a_projector(
    daemon: Daemon, projector: Path, tiny_path: Path, tmp_path: Path
) -> None:
    client = _ollama(daemon)
    data = projector.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.post(f"{daemon.url}/api/blobs/{digest}", content=data, timeout=60).status_code in (
        200,
        201,
    )
    client.create("tiny-seeing", from_="tiny", files=None, stream=False)  # no projector yet
    assert "vision" not in (client.show("tiny-seeing").capabilities or [])
    r = httpx.post(
        daemon.url + "/api/create",
        json={"model": "tiny-seeing", "modelfile": f"FROM tiny\nFROM {digest}\n", "stream": False},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    shown = client.show("tiny-seeing")
    assert "vision" in (shown.capabilities or [])
    froms = [ln for ln in (shown.modelfile or "").splitlines() if ln.startswith("FROM ")]
    assert len(froms) == 2  # the model, then the projector (as its blob, as Ollama shows it)
    assert froms[1].endswith("sha256-" + digest.removeprefix("sha256:"))
    reply = client.chat(
        "tiny-seeing",
        [{"role": "user", "content": "Hi", "images": [RED]}],
        options={"num_predict": 2},
    )
    assert (reply.prompt_eval_count or 0) > IMAGE_TOKENS
    # a second FROM that is not a projector (the model's own weights, stored by now)
    weights = "sha256:" + hashlib.sha256(tiny_path.read_bytes()).hexdigest()
    r = httpx.post(
        daemon.url + "/api/create",
        json={"model": "tiny-bad", "modelfile": f"FROM tiny\nFROM {weights}\n", "stream": False},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "projector" in r.json()["error"]
    # a projector made for another model (its image embeddings are 32 wide, not 64) is
    # tried beside the model in a child process first, and refused
    wrong = write_tiny_projector(tmp_path / "wrong.gguf", text=TinyShape(n_embd=32))
    data = wrong.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.post(f"{daemon.url}/api/blobs/{digest}", content=data, timeout=60).is_success
    r = httpx.post(
        daemon.url + "/api/create",
        json={"model": "tiny-wrong", "modelfile": f"FROM tiny\nFROM {digest}\n", "stream": False},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    assert "cannot be loaded" in r.json()["error"]
    assert "tiny-wrong" not in [m.model for m in client.list().models]


def test_projectors_come_with_registry_and_hugging_face_pulls(
    daemon: Daemon, registry: RegistryServer, tiny_path: Path, projector: Path
) -> None:
    registry.add_ollama_model("library/tiny-llava", "latest", tiny_path, projector=projector)
    registry.add_hf_file("org/vlm", "vlm-Q4_K_M.gguf", tiny_path)
    registry.add_hf_file("org/vlm", "mmproj-vlm-f16.gguf", projector)
    client = _ollama(daemon)
    for name in ("tiny-llava", "hf.co/org/vlm:Q4_K_M"):
        client.pull(name)
        assert "vision" in (client.show(name).capabilities or []), name
        reply = client.chat(
            name, [{"role": "user", "content": "Hi", "images": [BLUE]}], options={"num_predict": 2}
        )
        assert (reply.prompt_eval_count or 0) > IMAGE_TOKENS


# -- pieces ---------------------------------------------------------------------------


def test_image_headers_give_format_and_size_before_decoding() -> None:
    from barrel.errors import InvalidRequest
    from barrel.pipeline.images import dimensions

    assert dimensions(solid_png((0, 0, 0), 7, 5)) == ("png", 7, 5)
    assert dimensions(b"GIF89a" + (300).to_bytes(2, "little") + (200).to_bytes(2, "little")) == (
        "gif",
        300,
        200,
    )
    bmp = (
        b"BM" + bytes(16) + (640).to_bytes(4, "little") + (-480).to_bytes(4, "little", signed=True)
    )
    assert dimensions(bmp) == ("bmp", 640, 480)  # a negative height: stored top-down
    app0 = b"\xff\xe0" + (16).to_bytes(2, "big") + b"JFIF\x00" + bytes(9)
    sof2 = b"\xff\xc2" + (17).to_bytes(2, "big") + b"\x08" + (1080).to_bytes(2, "big")
    sof2 += (1920).to_bytes(2, "big") + bytes(10)
    assert dimensions(b"\xff\xd8" + app0 + sof2) == ("jpeg", 1920, 1080)
    for junk in (b"", b"\xff\xd8\xff", b"<svg/>", b"RIFF\x00\x00\x00\x00WEBPVP8 "):
        with pytest.raises(InvalidRequest):
            dimensions(junk)


def test_mmproj_flag_belongs_to_the_model_before_it() -> None:
    from barrel.cli import build_parser

    args = build_parser().parse_args(
        [
            *("serve", "--model", "a=/m/a.gguf", "--mmproj", "/m/a-mmproj.gguf"),
            *("--model", "b=/m/b.gguf", "--mmproj", "a=/m/other.gguf"),
        ]
    )
    assert args.mmproj == {"a": "/m/other.gguf"}  # NAME= names its model; the last wins
    args = build_parser().parse_args(
        ["serve", "--model", "a=/m/a.gguf", "--model", "b=/m/b.gguf", "--mmproj", "/m/p.gguf"]
    )
    assert args.mmproj == {"b": "/m/p.gguf"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mmproj", "/m/p.gguf"])


def test_concurrent_images_each_get_their_own_answer(daemon: Daemon) -> None:
    """Images evaluated between the steps of other sequences, several at once: each
    answer is the one its image gives alone."""
    client = _openai(daemon)

    def ask(png: bytes) -> str:
        content = [
            {"type": "image_url", "image_url": {"url": data_url(png)}},
            {"type": "text", "text": "Name the colour."},
        ]
        r = client.chat.completions.create(
            model="tiny-vision",
            messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
            temperature=0,
            max_tokens=12,
        )
        return r.choices[0].message.content or ""

    pngs = [solid_png((40 * i, 255 - 40 * i, 90)) for i in range(4)]
    alone = [ask(png) for png in pngs]
    assert len(set(alone)) > 1
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, [*pngs, *pngs]))
    assert together == alone + alone
