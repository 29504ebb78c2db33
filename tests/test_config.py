"""vm_config.toml: defaults, lookup order, errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from barrel import config
from barrel.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def key_paths(struct_type: Any, prefix: str = "") -> list[str]:
    paths = []
    for field in msgspec.structs.fields(struct_type):
        path = f"{prefix}{field.name}"
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            paths += key_paths(field.type, path + ".")
        else:
            paths.append(path)
    return paths


def test_shipped_vm_config_documents_every_setting_with_its_default() -> None:
    text = (REPO / "vm_config.toml").read_text()
    assert config.decode(text, "vm_config.toml") == config.Config()
    doc = msgspec.toml.decode(text)
    for path in key_paths(config.Config):
        node: Any = doc
        for part in path.split("."):
            assert part in node, f"vm_config.toml does not document {path}"
            node = node[part]


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"f\.toml: server: .*unknown field `prot`"):
        config.decode("[server]\nprot = 1\n", "f.toml")


def test_wrong_type_is_named_with_its_key_path() -> None:
    with pytest.raises(ConfigError, match=r"server\.port: Expected `int`, got `str`"):
        config.decode('[server]\nport = "eighty"\n')
    with pytest.raises(ConfigError, match=r"supervision\.root\.intensity"):
        config.decode("[supervision.root]\nintensity = 1.5\n")


def test_value_checks_name_every_bad_key() -> None:
    with pytest.raises(ConfigError) as info:
        config.decode('[server]\nport = 70000\n[models]\ndefault_keep_alive = "soon"\n')
    assert "server.port" in info.value.message
    assert "models.default_keep_alive" in info.value.message
    with pytest.raises(ConfigError, match=r"models\.defaults\.prefill_order"):
        config.decode('[models.defaults]\nprefill_order = "random"\n')


def test_invalid_toml_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.decode("[server\n")


def test_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = tmp_path / "explicit.toml"
    explicit.write_text("[server]\nport = 1111\n")
    from_env = tmp_path / "env.toml"
    from_env.write_text("[server]\nport = 2222\n")
    user = config.default_path()
    user.parent.mkdir(parents=True)
    user.write_text("[server]\nport = 3333\n")

    monkeypatch.setenv(config.ENV_VAR, str(from_env))
    assert config.load(str(explicit)).server.port == 1111
    assert config.load(None).server.port == 2222
    monkeypatch.delenv(config.ENV_VAR)
    assert config.load(None).server.port == 3333
    user.unlink()
    assert config.load(None) == config.Config()


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        config.load(str(tmp_path / "absent.toml"))


def test_structs_are_frozen() -> None:
    cfg = config.Config()
    with pytest.raises(AttributeError):
        cfg.server.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), ("250ms", 0.25), ("0", 0.0), ("-1", -1.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert config.parse_duration(text) == seconds


def test_bad_duration() -> None:
    with pytest.raises(ValueError, match="not a duration"):
        config.parse_duration("5 minutes")


def test_cache_root_defaults_to_user_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert config.Config().cache_root == tmp_path / "barrel"
    custom = config.decode(f'[models]\ncache_root = "{tmp_path}/c"\n')
    assert custom.cache_root == tmp_path / "c"


def test_fleet_settings_from_the_environment() -> None:
    base = config.Config()
    env = {"OLLAMA_KV_CACHE_TYPE": "q4_0", "OLLAMA_FLASH_ATTENTION": "1"}
    got = config.fleet_settings(base, env).models.defaults
    assert (got.kv_cache_type, got.flash_attn) == ("q4_0", "on")
    env |= {"BARREL_KV_CACHE_TYPE": "Q8_0", "BARREL_FLASH_ATTENTION": "false"}
    got = config.fleet_settings(base, env).models.defaults
    assert (got.kv_cache_type, got.flash_attn) == ("q8_0", "off")  # Barrel's names first
    assert config.fleet_settings(base, {"OLLAMA_KV_CACHE_TYPE": " "}) == base
    with pytest.raises(ConfigError, match="BARREL_KV_CACHE_TYPE: must be f16, q8_0 or q4_0"):
        config.fleet_settings(base, {"OLLAMA_KV_CACHE_TYPE": "q2"})
