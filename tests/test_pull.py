"""Pulls, creates and the model store through `barrel serve`, with the official ollama
SDK as client and real registry servers on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import pytest

from barrel.store.download import CHUNK
from barrel.store.synthetic import write_small_gguf
from tests.daemon import Daemon
from tests.registry_server import RegistryServer

TEMPLATE = "{{ .System }} {{ .Prompt }}"


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[RegistryServer]:
    root = tmp_path / "registry"
    root.mkdir()
    server = RegistryServer(root)
    yield server
    server.stop()


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_small_gguf(tmp_path / "small.gguf", padding_bytes=6 << 20)


class Env:
    def __init__(self, tmp_path: Path, registry: RegistryServer, **registry_opts: Any) -> None:
        self.cache = tmp_path / "cache"
        self.imports = tmp_path / "imports"
        self.imports.mkdir(exist_ok=True)
        self.config = tmp_path / "barrel.toml"
        extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in registry_opts.items())
        self.config.write_text(
            f'[models]\ncache_root = "{self.cache}"\nimport_dir = "{self.imports}"\n'
            # the registry serves small header-only GGUFs: what is tested is the pull
            "trial_load = false\n"
            f'[registry]\nhuggingface = "{registry.url}"\n{extra}'
            f'[registry.hosts]\n"registry.ollama.ai" = "{registry.url}"\n'
        )
        self.daemon: Daemon | None = None

    def start(self, preexec: Any = None) -> Daemon:
        self.daemon = Daemon("--config", str(self.config), cwd=self.config.parent, preexec=preexec)
        self.daemon.wait_listening()
        self.daemon.wait_line("supervision tree up")
        return self.daemon

    def client(self) -> ollama.Client:
        assert self.daemon is not None
        return ollama.Client(host=self.daemon.url, timeout=60)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.kill()


@pytest.fixture
def env(tmp_path: Path, registry: RegistryServer) -> Iterator[Env]:
    e = Env(tmp_path, registry)
    e.start()
    yield e
    e.stop()


def statuses(events: list[Any]) -> list[str]:
    return [e.status for e in events]


def test_pull_from_the_ollama_registry_reports_progress_in_order(
    env: Env, registry: RegistryServer, gguf: Path
) -> None:
    digest = registry.add_ollama_model(
        "library/small",
        "q4",
        gguf,
        template=TEMPLATE,
        params={"stop": ["<end>"], "temperature": 0.3},
    )
    events = list(env.client().pull("small:q4", stream=True))
    seq = statuses(events)
    assert seq[0] == "pulling manifest"
    assert seq[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    model_progress = [e for e in events if e.digest == digest]
    # Ollama's words: the first 12 hex digits in the status, the whole digest beside it
    assert {e.status for e in model_progress} == {f"pulling {digest.removeprefix('sha256:')[:12]}"}
    assert model_progress[-1].completed == model_progress[-1].total == gguf.stat().st_size
    done = [e.completed for e in model_progress]
    assert done == sorted(done), "completed only grows"
    # every blob is reported before the manifest is written
    assert seq.index("writing manifest") > max(
        i for i, s in enumerate(seq) if s.startswith("pulling ") and s != "pulling manifest"
    )

    listed = {m.model: m for m in env.client().list().models}
    assert "small:q4" in listed
    assert listed["small:q4"].details.family == "llama"
    info = env.client().show("small:q4")
    assert info.template == TEMPLATE
    assert '"<end>"' in info.parameters
    assert "temperature" in info.parameters
    assert info.modelinfo["llama.context_length"] == 131072
    assert set(info.capabilities) >= {"completion", "tools", "thinking"}


def test_pull_from_hugging_face_picks_the_quantisation(
    env: Env, registry: RegistryServer, tmp_path: Path
) -> None:
    q4 = write_small_gguf(tmp_path / "a.gguf", padding_bytes=1 << 20, seed=1)
    q8 = write_small_gguf(tmp_path / "b.gguf", padding_bytes=1 << 20, seed=2)
    registry.add_hf_file("org/repo", "model-Q8_0.gguf", q8)
    q4_digest = registry.add_hf_file("org/repo", "model-Q4_K_M.gguf", q4)
    client = env.client()
    events = list(client.pull("hf.co/org/repo:Q4_K_M", stream=True))
    assert events[-1].status == "success"
    assert any(e.digest == q4_digest for e in events)
    assert registry.bytes_served("model-Q8_0.gguf") == []
    events = list(client.pull("hf://org/repo/model-Q8_0.gguf", stream=True))
    assert events[-1].status == "success"
    names = {m.model for m in client.list().models}
    assert {"hf.co/org/repo:Q4_K_M", "hf.co/org/repo:model-Q8_0"} <= names
    with pytest.raises(ollama.ResponseError, match="no q2_k GGUF file"):
        client.pull("hf.co/org/repo:Q2_K")


def test_pull_from_a_url_and_a_local_file(env: Env, registry: RegistryServer, gguf: Path) -> None:
    registry.files["plain.gguf"] = gguf
    client = env.client()
    events = list(client.pull(f"{registry.url}/files/plain.gguf", stream=True))
    assert events[0].status == "pulling manifest"
    assert events[-1].status == "success"
    local = env.imports / "mine.gguf"
    local.write_bytes(gguf.read_bytes())
    assert client.pull(f"file://{local}").status == "success"
    names = {m.model for m in client.list().models}
    assert f"127.0.0.1:{registry.port}/url/plain:latest" in names
    assert "local/file/mine:latest" in names
    with pytest.raises(ollama.ResponseError) as info:
        client.pull(f"file://{gguf}")  # outside the import directory
    assert info.value.status_code == 400


def test_two_concurrent_pulls_download_once(env: Env, registry: RegistryServer, gguf: Path) -> None:
    registry.add_ollama_model("library/shared", "latest", gguf)
    registry.slow_after, registry.slow_delay = 1 << 20, 0.01
    results: list[list[str]] = []

    def pull() -> None:
        results.append(statuses(list(env.client().pull("shared", stream=True))))

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r[-1] for r in results] == ["success", "success"]
    model_blob = [s for s in registry.served if "/blobs/" in s.path and s.sent > 1000]
    assert len(model_blob) == 1, "the second pull joined the first instead of downloading"


def test_killed_pull_resumes_after_a_restart(
    tmp_path: Path, registry: RegistryServer, gguf: Path
) -> None:
    digest = registry.add_ollama_model("library/bigfile", "latest", gguf)
    registry.slow_after, registry.slow_delay = 2 << 20, 0.02
    env = Env(tmp_path, registry)
    daemon = env.start()
    partial = env.cache / "blobs" / f"{digest.replace(':', '-')}-partial"
    stream = env.client().pull("bigfile", stream=True)
    next(stream)  # the pull is under way
    deadline = time.monotonic() + 30
    while not (partial.exists() and partial.stat().st_size >= 3 << 20):
        assert time.monotonic() < deadline, (
            "the download never got going",
            list((env.cache / "blobs").iterdir()),
            registry.served,
            daemon.lines[-20:],
        )
        time.sleep(0.05)
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.wait(10)
    first = registry.bytes_served(digest)[0]
    kept = partial.stat().st_size

    registry.slow_after = None
    env.start()
    assert env.client().pull("bigfile").status == "success"
    resumed = registry.bytes_served(digest)[1]
    assert resumed.start == kept, "the second request asked for the rest with Range"
    assert first.sent - kept <= CHUNK + (256 << 10), "at most one chunk was fetched twice"
    blob = env.cache / "blobs" / digest.replace(":", "-")
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest.removeprefix("sha256:")
    assert not partial.exists()
    env.stop()


def test_digest_mismatch_removes_the_partial_and_writes_no_manifest(
    env: Env, registry: RegistryServer, gguf: Path
) -> None:
    digest = registry.add_ollama_model("library/bad", "latest", gguf)
    size = registry.blobs[digest].stat().st_size
    registry.blobs[digest].write_bytes(os.urandom(size))  # right size, not what the digest says
    with pytest.raises(ollama.ResponseError, match="digest"):
        env.client().pull("bad")
    blobs = env.cache / "blobs"
    assert not any(p.name.endswith("-partial") for p in blobs.iterdir())
    assert "bad:latest" not in {m.model for m in env.client().list().models}


def test_full_disk_fails_the_pull_without_a_manifest(
    tmp_path: Path, registry: RegistryServer, gguf: Path
) -> None:
    registry.add_ollama_model("library/huge", "latest", gguf)

    def small_files() -> None:
        # The kernel refuses writes past 2 MiB, as a full disk would (EFBIG, not a signal).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))

    env = Env(tmp_path, registry)
    env.start(preexec=small_files)
    try:
        with pytest.raises(ollama.ResponseError, match="File too large"):
            env.client().pull("huge")
        assert "huge:latest" not in {m.model for m in env.client().list().models}
        assert not (env.cache / "manifests" / "registry.ollama.ai" / "library" / "huge").exists()
        assert env.client().list() is not None, "the daemon still serves"
    finally:
        env.stop()


def test_non_streaming_pull_times_out_with_504_and_goes_on(
    tmp_path: Path, registry: RegistryServer, gguf: Path
) -> None:
    registry.add_ollama_model("library/slow", "latest", gguf)
    registry.slow_after, registry.slow_delay = 1 << 20, 0.01
    env = Env(tmp_path, registry, pull_timeout_s=0.5)
    env.start()
    try:
        with pytest.raises(ollama.ResponseError) as info:
            env.client().pull("slow")
        assert info.value.status_code == 504
        deadline = time.monotonic() + 60
        while "slow:latest" not in {m.model for m in env.client().list().models}:
            assert time.monotonic() < deadline, "the download stopped with the request"
            time.sleep(0.2)
    finally:
        env.stop()


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "a/b/c/d", "model:../x", "..:latest", "a/../b", "x" * 400]
)
def test_bad_names_are_refused_with_400(env: Env, name: str) -> None:
    client = env.client()
    for call in (lambda: client.pull(name), lambda: client.show(name), lambda: client.delete(name)):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 400, name


def test_path_traversal_in_digests_uploads_and_from_paths(env: Env, gguf: Path) -> None:
    import urllib.error
    import urllib.request

    assert env.daemon is not None
    for digest in ("sha256:../../../etc/passwd", "sha256:" + "g" * 64, "md5:abc"):
        for method in ("HEAD", "POST"):
            req = urllib.request.Request(
                f"{env.daemon.url}/api/blobs/{digest}", data=b"x", method=method
            )
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=10)
            assert info.value.code in (400, 404), (
                digest,
                method,
            )  # 404: the router refused the path
    client = env.client()
    wrong = "sha256:" + "0" * 64
    req = urllib.request.Request(
        f"{env.daemon.url}/api/blobs/{wrong}", data=b"not that", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400
    for source in ("../../etc/passwd", "/etc/passwd", "./../outside.gguf"):
        with pytest.raises(ollama.ResponseError) as err:
            client.create("evil", from_=source)
        assert err.value.status_code == 400, source
    assert list((env.cache / "blobs").glob(".upload-*")) == []


def _corrupt(tmp_path: Path, gguf: Path) -> dict[str, Path]:
    data = gguf.read_bytes()
    cases = {
        "truncated": data[:200],
        "bad-magic": b"GGML" + data[4:],
        # the first key's string length says a petabyte
        "absurd-length": data[:24] + (1 << 50).to_bytes(8, "little") + data[32:],
    }
    out = {}
    for name, blob in cases.items():
        out[name] = tmp_path / f"{name}.gguf"
        out[name].write_bytes(blob)
    return out


def test_corrupted_gguf_is_refused_and_the_daemon_lives(
    env: Env, gguf: Path, tmp_path: Path
) -> None:
    client = env.client()
    for label, path in _corrupt(tmp_path, gguf).items():
        digest = client.create_blob(path)
        with pytest.raises(ollama.ResponseError) as info:
            client.create(f"broken-{label}", files={"model.gguf": digest})
        assert info.value.status_code == 400, label
    assert client.list().models == [], "nothing was created, and the daemon still answers"


def test_delete_then_prune_removes_only_unreferenced_blobs(
    env: Env, gguf: Path, tmp_path: Path
) -> None:
    client = env.client()
    shared = client.create_blob(gguf)
    other = client.create_blob(
        write_small_gguf(tmp_path / "other.gguf", padding_bytes=1 << 20, seed=9)
    )
    client.create("keep", files={"m.gguf": shared}, system="I stay")
    client.create("drop", files={"m.gguf": shared}, system="I go")
    client.create("alone", files={"m.gguf": other})
    blobs = env.cache / "blobs"

    def digests() -> set[str]:
        return {p.name for p in blobs.iterdir() if p.name.startswith("sha256-")}

    before = digests()
    client.delete("drop")
    client.delete("alone")
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("drop")
    assert info.value.status_code == 404
    assert digests() == before, "delete leaves blobs alone"
    assert env.daemon is not None
    import urllib.request

    with urllib.request.urlopen(
        urllib.request.Request(f"{env.daemon.url}/api/prune", data=b"{}", method="POST"), timeout=10
    ) as resp:
        removed = set(json.loads(resp.read())["removed_blobs"])
    after = digests()
    assert shared.replace(":", "-") in after, "the blob 'keep' still uses survives"
    assert other.replace(":", "-") not in after
    assert {d.replace(":", "-") for d in removed} == before - after
    assert "I stay" in client.show("keep").modelfile
    assert {m.model for m in client.list().models} == {"keep:latest"}


def test_create_with_the_sdk_then_show(env: Env, gguf: Path) -> None:
    client = env.client()
    digest = client.create_blob(gguf)
    progress = list(
        client.create(
            "custom:v1",
            files={"model.gguf": digest},
            template=TEMPLATE,
            system="You are terse.",
            parameters={"num_ctx": 8192, "stop": ["END", "<|im_end|>"], "temperature": 0.1},
            stream=True,
        )
    )
    assert progress[-1].status == "success"
    info = client.show("custom:v1")
    assert info.template == TEMPLATE
    params = info.parameters.splitlines()
    assert any(line.split() == ["num_ctx", "8192"] for line in params)
    assert any(line.split() == ["stop", '"END"'] for line in params)
    assert "SYSTEM" in info.modelfile
    assert "You are terse." in info.modelfile
    assert info.details.parameter_size
    assert info.details.quantization_level == "F32"
    # a model made FROM it inherits and overrides
    client.create("derived", from_="custom:v1", parameters={"num_ctx": 2048})
    derived = client.show("derived")
    assert derived.template == TEMPLATE
    assert any(line.split() == ["num_ctx", "2048"] for line in derived.parameters.splitlines())
    client.copy("derived", "copied:x")
    assert client.show("copied:x").parameters == derived.parameters
    with pytest.raises(ollama.ResponseError) as info_err:
        client.create("q", files={"model.gguf": digest}, quantize="q4_K_M")
    assert info_err.value.status_code == 400


def test_create_from_modelfile_text_and_edit(env: Env, gguf: Path) -> None:
    import urllib.error
    import urllib.request

    client = env.client()
    digest = client.create_blob(gguf)
    client.create("base", files={"model.gguf": digest})
    assert env.daemon is not None

    def post(path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        req = urllib.request.Request(
            f"{env.daemon.url}{path}", data=json.dumps(body).encode(), method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    modelfile = 'FROM base\nPARAMETER num_ctx 4096\nSYSTEM """Be kind."""\nMESSAGE user hi\n'
    status, body = post(
        "/api/create", {"model": "from-text", "modelfile": modelfile, "stream": False}
    )
    assert status == 200, body
    assert client.show("from-text").modelfile.count("num_ctx") == 1
    status, body = post(
        "/api/create", {"model": "x", "modelfile": "FROM base\nPARAMETER num_ctx many\n"}
    )
    assert status == 400
    assert b"line 2" in body
    status, _ = post("/api/edit", {"model": "from-text", "parameters": {"num_ctx": 16384}})
    assert status == 200
    assert any(
        line.split() == ["num_ctx", "16384"]
        for line in client.show("from-text").parameters.splitlines()
    )
    status, body = post("/api/edit", {"model": "from-text", "parameters": {"num_ctx": "big"}})
    assert status == 400


def test_aliases_and_search(env: Env, registry: RegistryServer, gguf: Path) -> None:
    registry.add_ollama_model("library/coder-7b", "main", gguf)
    assert env.client().pull("fast").status == "success"  # fast -> coder-7b:main
    assert "coder-7b:main" in {m.model for m in env.client().list().models}
    import urllib.request

    assert env.daemon is not None
    req = urllib.request.Request(
        f"{env.daemon.url}/api/search", data=json.dumps({"query": "coder"}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        found = json.loads(resp.read())["models"]
    assert {f["source"] for f in found} == {"local", "registry"}


def test_prune_from_the_cli(env: Env, gguf: Path) -> None:
    import subprocess
    import sys

    client = env.client()
    digest = client.create_blob(gguf)  # uploaded, never used by a model
    assert env.daemon is not None
    proc = subprocess.run(
        [sys.executable, "-m", "barrel", "prune", "--host", env.daemon.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "removed 1 unused blobs" in proc.stdout
    assert not (env.cache / "blobs" / digest.replace(":", "-")).exists()
    down = subprocess.run(
        [sys.executable, "-m", "barrel", "prune", "--host", "http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1
    assert "barrel serve" in down.stderr


def test_insecure_pulls_from_a_plain_http_registry_and_says_so_without_it(
    tmp_path: Path, registry: RegistryServer, gguf: Path
) -> None:
    """A registry the configuration does not name, on plain http (as `ollama pull
    --insecure` reaches one); private addresses allowed by the configuration."""
    (tmp_path / "plain").mkdir()
    plain = RegistryServer(tmp_path / "plain")
    try:
        plain.add_ollama_model("library/plain", "latest", gguf)
        (tmp_path / "daemon").mkdir()
        e = Env(tmp_path / "daemon", registry, private_networks=True)
        e.start()
        try:
            name = f"127.0.0.1:{plain.port}/library/plain"
            with pytest.raises(ollama.ResponseError) as refused:
                e.client().pull(name)
            assert "insecure" in str(refused.value)
            done = e.client().pull(name, insecure=True)
            assert done.status == "success"
            assert name + ":latest" in {m.model for m in e.client().list().models}
        finally:
            e.stop()
    finally:
        plain.stop()
