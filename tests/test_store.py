"""Store building blocks: names, digests, the bounded GGUF reader, Modelfiles."""

from __future__ import annotations

import itertools
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from barrel.errors import InvalidRequest
from barrel.store.gguf_meta import InvalidGGUF, plain_attention, read_gguf
from barrel.store.manifests import ManifestStore
from barrel.store.modelfile import ModelfileError, parse
from barrel.store.names import InvalidName, ModelName, parse_digest
from barrel.store.store import ModelStore
from barrel.store.synthetic import write_small_gguf


@pytest.mark.parametrize(
    ("text", "parts", "short"),
    [
        ("qwen", ("registry.ollama.ai", "library", "qwen", "latest"), "qwen:latest"),
        ("qwen:0.5b", ("registry.ollama.ai", "library", "qwen", "0.5b"), "qwen:0.5b"),
        ("me/tool:v1", ("registry.ollama.ai", "me", "tool", "v1"), "me/tool:v1"),
        ("hf.co/org/repo:Q4_K_M", ("hf.co", "org", "repo", "Q4_K_M"), "hf.co/org/repo:Q4_K_M"),
        ("localhost:5000/a/b:c", ("localhost:5000", "a", "b", "c"), "localhost:5000/a/b:c"),
    ],
)
def test_names(text: str, parts: tuple[str, ...], short: str) -> None:
    name = ModelName.parse(text)
    assert name.parts == parts
    assert str(name) == short
    assert ModelName.parse(str(name)) == name


@pytest.mark.parametrize(
    "bad",
    ["", "../x", "a/../b", "x:..", "a/b/c/d", "a:b:c", ".hidden", "x y", "a\\b", "é", "x" * 81],
)
def test_bad_names(bad: str) -> None:
    with pytest.raises(InvalidName):
        ModelName.parse(bad)


@given(st.text(max_size=120))
def test_no_name_escapes_the_manifest_directory(text: str) -> None:
    try:
        name = ModelName.parse(text)
    except InvalidName:
        return
    root = Path("/cache/manifests")
    path = root.joinpath(*name.parts)
    assert path.resolve().is_relative_to(root)
    assert all(part not in ("", ".", "..") and "/" not in part for part in name.parts)


def test_digests() -> None:
    hexdigest = "a" * 64
    assert parse_digest(f"sha256:{hexdigest}") == hexdigest
    assert parse_digest(f"sha256-{hexdigest}") == hexdigest
    for bad in ("sha256:" + "A" * 64, "sha256:../../etc", "md5:abc", "sha256:" + "a" * 63, ""):
        with pytest.raises(InvalidRequest):
            parse_digest(bad)


def test_manifest_paths_stay_inside(tmp_path: Path) -> None:
    store = ManifestStore(tmp_path)
    path = store.path(ModelName.parse("host.example:8080/ns/model:tag"))
    assert path.resolve().is_relative_to(tmp_path)


def test_gguf_reader_on_real_models(qwen_path: Path, gemma_path: Path) -> None:
    qwen = read_gguf(qwen_path)
    assert (qwen.architecture, qwen.quantization, qwen.context_length) == ("qwen2", "Q4_K_M", 32768)
    assert (qwen.embedding_length, qwen.block_count, qwen.head_count_kv) == (896, 24, 2)
    assert qwen.size_label == "0.5B"
    assert 600e6 < qwen.parameter_count < 700e6
    assert qwen.capabilities == ["completion", "tools", "insert"]
    assert qwen.get("tokenizer.ggml.model") == "gpt2"
    gemma = read_gguf(gemma_path)
    assert gemma.architecture == "gemma3"
    assert gemma.capabilities == ["completion"]
    # what kv_per_sequence "auto" asks: Gemma 3's sliding-window layers rule it out
    assert qwen.plain_attention
    assert not gemma.plain_attention
    assert plain_attention(qwen.model_info())
    assert not plain_attention(gemma.model_info())
    assert not plain_attention({"general.architecture": "mamba", "mamba.ssm.conv_kernel": 4})


def _bad_files(tmp_path: Path) -> dict[str, bytes]:
    good = write_small_gguf(tmp_path / "good.gguf").read_bytes()
    # offset 24: the first key's length; 24 + 8 + len("general.architecture") + 4: first value
    key_len = int.from_bytes(good[24:32], "little")
    value_at = 32 + key_len + 4
    return {
        "empty": b"",
        "bad magic": b"GGML" + good[4:],
        "truncated": good[:100],
        "huge string": good[:24] + (1 << 60).to_bytes(8, "little") + good[32:],
        "huge counts": good[:8] + (1 << 62).to_bytes(8, "little") + good[16:],
        "huge array": good[: value_at - 4]
        + (9).to_bytes(4, "little")
        + (8).to_bytes(4, "little")
        + (1 << 40).to_bytes(8, "little")
        + good[value_at + 8 :],
        "bad version": good[:4] + (99).to_bytes(4, "little") + good[8:],
    }


def test_malformed_gguf_is_refused_without_a_big_allocation(tmp_path: Path) -> None:
    for label, data in _bad_files(tmp_path).items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(data)
        tracemalloc.start()
        try:
            with pytest.raises(InvalidGGUF):
                read_gguf(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, (label, peak)


def _vocab_gguf(path: Path, tokens: list[str]) -> bytes:
    """A header with a vocabulary and merges (the arrays a real model spends its
    header on), and the bytes written."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_token_list(tokens)
    w.add_token_merges([f"{a} {b}" for a, b in itertools.pairwise(tokens)])
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_a_vocabulary_is_read_through_and_checked(tmp_path: Path) -> None:
    """Thousands of length-prefixed strings read through the reader's own buffer: what
    comes after them is read right, a fill-in-the-middle token is noticed, and a token
    that is cut off or claims more bytes than the file has is refused."""
    tokens = [f"tok{i:05d}" * (1 + i % 7) for i in range(30_000)] + ["<|fim_prefix|>"]
    data = _vocab_gguf(tmp_path / "vocab.gguf", tokens)
    info = read_gguf(tmp_path / "vocab.gguf")
    assert info.has_fim_tokens
    assert info.block_count == 1  # the key written before the arrays
    assert info.parameter_count == len(tokens) * 4  # the tensor infos after them
    _vocab_gguf(tmp_path / "plain.gguf", tokens[:-1])
    assert not read_gguf(tmp_path / "plain.gguf").has_fim_tokens

    last = data.index(b"tok29999")  # a token past the first megabyte of the header
    assert last > 1 << 20
    claim = last - 8  # its length prefix
    bad = {
        "cut in the vocabulary": data[: last + 3],
        "a token longer than the file": data[:claim]
        + (len(data)).to_bytes(8, "little")
        + data[claim + 8 :],
        "a token over 64 KiB": data[:claim] + (1 << 17).to_bytes(8, "little") + data[claim + 8 :],
    }
    for label, content in bad.items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(content)
        with pytest.raises(InvalidGGUF, match=r"truncated|claims") as refused:
            read_gguf(path)
        assert refused.value.status == 400, label


def test_a_long_string_in_a_skipped_array_is_not_read_into_memory(tmp_path: Path) -> None:
    """A merges entry of 8 MiB (an array the reader skips) costs a seek, not 8 MiB."""
    w = gguf.GGUFWriter(tmp_path / "long.gguf", "llama")
    w.add_block_count(1)
    w.add_token_merges(["a b", "x" * (8 << 20), "c d"])
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tracemalloc.start()
    try:
        info = read_gguf(tmp_path / "long.gguf")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.parameter_count == 16  # the tensor infos after the array were read
    assert peak < 4 << 20, peak


def test_the_store_reads_a_blob_header_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blob never changes: the header a create reads (in the import thread, then in
    the store actor for the config layer) is parsed once."""
    store = ModelStore(tmp_path / "store", trial_load=False)
    digest = store.blobs.put_bytes(write_small_gguf(tmp_path / "small.gguf").read_bytes())
    reads: list[Path] = []

    def counting(path: Path) -> object:
        reads.append(Path(path))
        return read_gguf(path)

    monkeypatch.setattr("barrel.store.store.read_gguf", counting)
    first = store.model_layer(digest)
    assert store.model_layer(digest) == first
    assert not store.is_projector(digest)
    assert reads == [store.blobs.path(digest)]
    store.create("a", parse(f"FROM {digest}\nSYSTEM hi\n"))
    store.create("b", parse(f"FROM {digest}\nSYSTEM ho\n"))
    assert len(reads) == 1
    assert store.get("b").manifest.config == store.get("a").manifest.config


def test_modelfile_errors_name_the_line() -> None:
    cases = {
        "FROM x\nPARAMETER num_ctx lots\n": "line 2",
        "FROM x\n\nPARAMETER bogus 1\n": "line 3: unknown parameter",
        'FROM x\nSYSTEM """never closed\n': "line 2: unterminated",
        "FROM x\nMESSAGE robot hi\n": "line 2: MESSAGE role",
        "FROM x\nFOO bar\n": "line 2: unknown instruction",
        "PARAMETER temperature 1\n": "no FROM line",
        "FROM x\nPARAMETER weight_residency sometimes\n": "line 2: weight_residency must be",
    }
    for text, message in cases.items():
        with pytest.raises(ModelfileError, match=message):
            parse(text)


def test_modelfile_round_trip() -> None:
    text = (
        'FROM qwen:0.5b\nTEMPLATE """{{ .Prompt }}"""\nSYSTEM """multi\nline"""\n'
        "ADAPTER sha256:" + "b" * 64 + "\n"
        'PARAMETER stop "<|im_end|>"\nPARAMETER stop END\nPARAMETER num_ctx 8192\n'
        "PARAMETER weight_residency lazy\nPARAMETER use_mlock true\n"
        'MESSAGE user "hi there"\nLICENSE """MIT"""\n'
    )
    mf = parse(text)
    assert mf.parameters == {
        "stop": ["<|im_end|>", "END"],
        "num_ctx": 8192,
        "weight_residency": "lazy",
        "use_mlock": True,
    }
    assert parse(mf.render()) == mf


def test_an_unchanged_file_is_imported_once(tmp_path: Path) -> None:
    """A create FROM a local file copies it into the blob store once: the same
    unchanged file again finds its blob (not copied over: the same inode); a changed
    file, or a blob pruned since, is read again."""
    imports = tmp_path / "imports"
    imports.mkdir()
    store = ModelStore(tmp_path / "store", imports, trial_load=False)
    source = write_small_gguf(imports / "m.gguf")
    store.create("a", parse("FROM m.gguf\n"))
    blob = store.get("a").model_path
    assert blob is not None
    digest = "sha256:" + blob.name.removeprefix("sha256-")
    inode = blob.stat().st_ino
    store.create("b", parse("FROM m.gguf\nSYSTEM hi\n"))
    assert store.get("b").model_path == blob
    assert blob.stat().st_ino == inode

    write_small_gguf(source, seed=6)  # new content
    changed = store.import_file(source)
    assert changed != digest
    store.blobs.path(changed).unlink()  # as prune does once no manifest names it
    assert store.import_file(source) == changed
    assert store.blobs.path(changed).is_file()
