"""vm_config.toml decoded into frozen msgspec structs.

Lookup order: `--config PATH`, then `$BARREL_CONFIG`, then `<user config dir>/barrel/
vm_config.toml` when it exists, else the defaults below. An unknown key or a value of the
wrong type is a `ConfigError` naming the key path (the CLI exits 2 on it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
import platformdirs

from barrel.errors import ConfigError

ENV_VAR = "BARREL_CONFIG"
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ServerConfig(_Section, frozen=True):
    host: str = "127.0.0.1"
    port: int = 8080
    # Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    shutdown_grace_s: float = 30.0
    access_log: bool = True
    log_level: str = "info"
    # POST /debug/crash {"model": NAME} kills that model's engine thread: for soak tests
    # (bench/soak.py) only, never on a daemon others use.
    fault_injection: bool = False


class LimitsConfig(_Section, frozen=True):
    """What one request may ask for: every size a client chooses is bounded here."""

    max_request_body_bytes: int = 1024 * 1024
    max_messages: int = 1024
    max_tools: int = 128
    max_embedding_inputs: int = 256
    max_json_depth: int = 64  # nesting of a JSON body
    max_stop: int = 16  # stop strings per request
    max_stop_length: int = 256  # characters in one stop string
    max_sequences: int = 16  # engine sequences one request runs (prompts x n)
    max_schema_bytes: int = 64 * 1024  # a response format's or a tool's JSON schema
    max_grammar_bytes: int = 256 * 1024  # the llguidance grammar a format becomes
    # No effect: older config files set it. llguidance bounds every grammar step.
    max_schema_repeat: int = 256
    template_render_s: float = 5.0  # time to render one chat template
    grammar_sample_s: float = 2.0  # time to sample one token under a grammar
    max_images: int = 16  # images in one request
    # One image's bytes (inline images also count against max_request_body_bytes).
    max_image_bytes: int = 10 * 1024 * 1024
    # One image's pixels, from its header (a small file may declare a huge picture).
    max_image_pixels: int = 50_000_000
    max_audio_clips: int = 8  # audio clips in one request
    # One clip's bytes (OpenAI's upload limit; inline clips also count against
    # max_request_body_bytes).
    max_audio_bytes: int = 25 * 1024 * 1024
    # One clip's length, read from its header (and for MP3 and FLAC its frames) before
    # anything decodes it: a few kilobytes may hold hours of silence.
    max_audio_seconds: float = 600.0
    # tokens one answer may generate, whatever the request or the model asks (beyond it
    # the answer ends with finish_reason "length", as llama-server's --n-predict); 0:
    # up to the context
    max_tokens: int = 0


class ResponsesConfig(_Section, frozen=True):
    # Stored responses (for previous_response_id) live this long, in memory.
    store_ttl_s: float = 3600.0
    max_stored: int = 1000


class CorsConfig(_Section, frozen=True):
    # Empty list: CORS off. ["*"] allows any origin.
    allow_origins: list[str] = msgspec.field(default_factory=list)
    allow_methods: list[str] = msgspec.field(
        default_factory=lambda: ["GET", "POST", "DELETE", "HEAD", "OPTIONS"]
    )
    allow_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    max_age_s: int = 600


class AuthConfig(_Section, frozen=True):
    # Empty list: no authentication. Otherwise `Authorization: Bearer <key>` or
    # `x-api-key: <key>` must carry one of these on every path but /health*.
    api_keys: list[str] = msgspec.field(default_factory=list)


class SupervisorLimits(_Section, frozen=True):
    intensity: int = 3
    period_s: float = 5.0


class SupervisionConfig(_Section, frozen=True):
    root: SupervisorLimits = msgspec.field(default_factory=SupervisorLimits)
    models: SupervisorLimits = msgspec.field(
        default_factory=lambda: SupervisorLimits(intensity=5, period_s=60.0)
    )
    pulls: SupervisorLimits = msgspec.field(
        default_factory=lambda: SupervisorLimits(intensity=10, period_s=60.0)
    )


class ModelDefaults(_Section, frozen=True):
    num_seq_max: int = 4
    num_batch: int = 512
    # While other requests generate, a step takes about this long of a new prompt (its
    # chunk sized by what prompt rows cost lately, at least 128 rows): a longer step
    # gives new prompts their first token sooner and the running streams a longer pause.
    # 0: 128 prompt rows a step.
    prefill_step_s: float = 2.0
    # Prompts read at once take a step's rows in "arrival" order, or "shortest" first
    # (the oldest keeps a quarter).
    prefill_order: str = "arrival"
    num_thread: int = 0  # 0: the machine's cores
    kv_cache_type: str = "f16"  # f16 | q8_0 | q4_0
    flash_attn: str = "auto"  # auto | on | off
    # true: a KV cache of num_ctx cells for each of num_seq_max sequences and the pinned
    # prefix (as llama-server's -np, Ollama's num_ctx x OLLAMA_NUM_PARALLEL), instead of
    # one num_ctx cache they share (false): that much more memory, faster prefills and
    # follow-up turns on a CPU, and greedy answers depend on how tokens were batched more
    # often (bench/NOTEBOOK.md). "auto": true for a model that runs on the CPU with
    # plain attention (no sliding window, no recurrent state), as long as the memory it
    # adds neither refuses the load nor unloads another model (memory-aware loading) nor
    # exceeds the memory free at load.
    kv_per_sequence: bool | Literal["auto"] = "auto"
    speculation: str = "ngram"  # ngram (prompt-lookup drafts) | off
    # true: load weights into llama.cpp's extra (CPU repack) buffers, as llama-server
    # does: faster prompts, but a greedy answer then depends on how many sequences
    # shared its steps (bench/NOTEBOOK.md). "auto": true unless the daemon is
    # batch-invariant ([models] batch_invariant). Never on a CPU with AMX, true
    # included: the pinned llama.cpp build crashes with them there.
    extra_buffers: bool | Literal["auto"] = "auto"
    draft_max: int = 64  # draft tokens verified per step at most
    queue_depth: int = 16  # requests that may wait per model beyond num_seq_max running
    queue_timeout_s: float = 300.0  # a request waiting longer gets 503
    load_timeout_s: float = 600.0


class RegistryConfig(_Section, frozen=True):
    # Base URL by registry host; a host not listed is reached at https://<host>.
    hosts: dict[str, str] = msgspec.field(
        default_factory=lambda: {"registry.ollama.ai": "https://registry.ollama.ai"}
    )
    huggingface: str = "https://huggingface.co"
    # Pulls from sources not configured here may reach private, loopback and link-local
    # addresses (off: a client cannot make the daemon fetch from its own network).
    private_networks: bool = False
    # Origins (scheme://host[:port]) image URLs may be fetched from as written, plain
    # http and private addresses included; any other image URL must be public https.
    image_origins: list[str] = msgspec.field(default_factory=list)
    # A non-streaming pull answers 504 after this long; the download goes on.
    pull_timeout_s: float = 600.0


class ModelsConfig(_Section, frozen=True):
    cache_root: str = ""  # empty: <user data dir>/barrel
    # FROM paths and file:// pulls must resolve inside it; empty: <cache_root>/imports
    import_dir: str = ""
    max_context_size: int = 4096
    default_keep_alive: str = "5m"
    # Estimate each model's memory before loading it and unload idle ones to make room.
    memory_aware_loading: bool = False
    memory_budget_bytes: int = 0  # 0: no budget beyond free memory and the cgroup limit
    model_load_memory_margin_b: int = 1 << 30
    weight_residency_default: str = "eager"  # eager | lazy | pinned | lazy_then_pin_resident
    # Evictor: below this much available memory, unload idle models one per interval.
    memory_watermark_bytes: int = 0  # 0: off
    evictor_interval_s: float = 5.0
    # Conversations kept across unloads and restarts: the KV states of a model's sequences
    # are written under <cache_root>/kv-states as its engine stops (not when it crashes)
    # and restored when a prompt extends one. One budget for all models, least recently
    # used first; 0: off.
    kv_states_bytes: int = 4 << 30
    # New model files (created, pulled) must load and run in a child process first: an
    # abort inside llama.cpp then fails the create or pull instead of the daemon.
    trial_load: bool = True
    # true: a row's logits never depend on what shares its decode step (ggml's tiled
    # matmul and the repacked weight buffers off): a greedy answer is the same alone,
    # beside other streams and under speculation, and long prompts are read 12-40 %
    # slower on a CPU. false: llama.cpp's own kernels, as llama-server runs them. One
    # choice for the whole daemon, made at start (BARREL_BATCH_INVARIANT=1|0 wins).
    batch_invariant: bool = False
    defaults: ModelDefaults = msgspec.field(default_factory=ModelDefaults)
    # Alias name -> model name.
    aliases: dict[str, str] = msgspec.field(
        default_factory=lambda: {"fast": "coder-7b:main", "big": "qwen3-coder:30b"}
    )
    # Local GGUF files registered at boot: name -> path (same as `--model NAME=PATH`).
    local: dict[str, str] = msgspec.field(default_factory=dict)
    # Draft models: model name -> the name of a model of the same vocabulary that drafts
    # tokens for it (speculative decoding; a Modelfile's PARAMETER draft_model wins).
    drafts: dict[str, str] = msgspec.field(default_factory=dict)
    # Vision projectors of local files: name -> projector GGUF (same as `--mmproj`).
    projectors: dict[str, str] = msgspec.field(default_factory=dict)


class McpServerConfig(_Section, frozen=True):
    """One MCP tool server: a command to run (stdio) or a streamable-HTTP URL."""

    command: list[str] = msgspec.field(default_factory=list)  # argv; stdio
    env: dict[str, str] = msgspec.field(default_factory=dict)  # over the daemon's
    cwd: str = ""
    url: str = ""  # streamable HTTP
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    # header -> environment variable holding its value (a token kept out of the file)
    headers_env: dict[str, str] = msgspec.field(default_factory=dict)
    tools: list[str] = msgspec.field(default_factory=list)  # offered; empty: all it lists
    # With API keys: key -> the tools it may call ("*": all); empty: every key, all tools.
    keys: dict[str, list[str]] = msgspec.field(default_factory=dict)
    anonymous: bool = False  # usable by callers without an API key (a daemon without keys)
    timeout_s: float = 30.0  # one call, queueing for the server included
    max_concurrent: int = 4  # calls in flight on this server
    max_result_bytes: int = 64 * 1024  # a result's text the model sees (cut, with a note)


class McpConfig(_Section, frozen=True):
    servers: dict[str, McpServerConfig] = msgspec.field(default_factory=dict)
    max_rounds: int = 8  # server-tool rounds in one turn; then the turn ends as it stands
    connect_timeout_s: float = 30.0  # start, initialize and list tools
    max_backoff_s: float = 30.0  # between restarts of a server that keeps ending


class Config(_Section, frozen=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    responses: ResponsesConfig = msgspec.field(default_factory=ResponsesConfig)
    cors: CorsConfig = msgspec.field(default_factory=CorsConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    supervision: SupervisionConfig = msgspec.field(default_factory=SupervisionConfig)
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    registry: RegistryConfig = msgspec.field(default_factory=RegistryConfig)
    mcp: McpConfig = msgspec.field(default_factory=McpConfig)

    @property
    def cache_root(self) -> Path:
        if self.models.cache_root:
            return Path(self.models.cache_root).expanduser()
        return Path(platformdirs.user_data_dir("barrel"))

    @property
    def kv_states_dir(self) -> Path:
        return self.cache_root / "kv-states"

    @property
    def import_dir(self) -> Path:
        if self.models.import_dir:
            return Path(self.models.import_dir).expanduser()
        return self.cache_root / "imports"

    def resolve_alias(self, name: str) -> str:
        return self.models.aliases.get(name, name)


def parse_duration(text: str) -> float:
    """'5m' -> 300.0, '30s', '1h', '250ms', or a bare number of seconds."""
    m = _DURATION.match(text.strip())
    if m is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 5m, 1h)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def default_path() -> Path:
    return Path(platformdirs.user_config_dir("barrel")) / "vm_config.toml"


def find_config(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    path = default_path()
    return path if path.exists() else None


def decode(data: bytes | str, source: str = "<config>") -> Config:
    try:
        config = msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_name_key_path(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    validate(config, source)
    return config


def load(explicit: str | None = None) -> Config:
    path = find_config(explicit)
    if path is None:
        return fleet_settings(Config(), os.environ)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    return fleet_settings(decode(data, str(path)), os.environ)


# Machine-wide settings from the environment, over the file, as Ollama's are set for a
# fleet (a systemd drop-in, a container image): Barrel's names first, Ollama's after.
_KV_TYPE_VARS = ("BARREL_KV_CACHE_TYPE", "OLLAMA_KV_CACHE_TYPE")
_FLASH_VARS = ("BARREL_FLASH_ATTENTION", "OLLAMA_FLASH_ATTENTION")


def fleet_settings(config: Config, env: Mapping[str, str]) -> Config:
    """`config` with the KV cache type and flash attention the environment sets."""
    defaults = config.models.defaults
    kv = next((env[v].strip().lower() for v in _KV_TYPE_VARS if env.get(v, "").strip()), None)
    flash = next((env[v].strip().lower() for v in _FLASH_VARS if env.get(v, "").strip()), None)
    if kv is not None:
        if kv not in ("f16", "q8_0", "q4_0"):
            raise ConfigError(f"{_KV_TYPE_VARS[0]}: must be f16, q8_0 or q4_0, not {kv!r}")
        defaults = msgspec.structs.replace(defaults, kv_cache_type=kv)
    if flash is not None:
        words = {"1": "on", "true": "on", "on": "on", "0": "off", "false": "off"}
        words |= {"off": "off", "auto": "auto"}
        if flash not in words:
            raise ConfigError(f"{_FLASH_VARS[0]}: must be 1, 0, true, false or auto")
        defaults = msgspec.structs.replace(defaults, flash_attn=words[flash])
    models = msgspec.structs.replace(config.models, defaults=defaults)
    return msgspec.structs.replace(config, models=models)


def _name_key_path(message: str) -> str:
    # msgspec ends messages with "- at `$.server.port`"; say it as a key path.
    m = re.search(r" - at `\$\.?([^`]*)`$", message)
    if m is None:
        return message
    return f"{m.group(1) or '<top level>'}: {message[: m.start()]}"


def validate(config: Config, source: str) -> None:
    """Checks the types cannot express. Raises ConfigError naming every bad key."""
    errors: list[str] = []
    if not 0 <= config.server.port <= 65535:
        errors.append("server.port: must be between 0 and 65535")
    for key, value in msgspec.structs.asdict(config.limits).items():
        if value < 0 or (value == 0 and key != "max_tokens"):
            errors.append(f"limits.{key}: must be positive")
    if config.responses.store_ttl_s <= 0 or config.responses.max_stored < 0:
        errors.append("responses: store_ttl_s > 0 and max_stored >= 0 required")
    if config.models.kv_states_bytes < 0:
        errors.append("models.kv_states_bytes: must be 0 (off) or more")
    if config.models.max_context_size < 64:
        errors.append("models.max_context_size: must be at least 64")
    if not 0 <= config.models.defaults.prefill_step_s <= 60:
        errors.append("models.defaults.prefill_step_s: must be 0 to 60")
    if config.models.defaults.prefill_order not in ("shortest", "arrival"):
        errors.append('models.defaults.prefill_order: must be "shortest" or "arrival"')
    if config.models.defaults.num_seq_max < 1:
        errors.append("models.defaults.num_seq_max: must be at least 1")
    if config.models.defaults.kv_cache_type not in ("f16", "q8_0", "q4_0"):
        errors.append("models.defaults.kv_cache_type: must be f16, q8_0 or q4_0")
    if config.models.defaults.flash_attn not in ("auto", "on", "off"):
        errors.append("models.defaults.flash_attn: must be auto, on or off")
    if config.models.defaults.speculation not in ("ngram", "off"):
        errors.append("models.defaults.speculation: must be ngram or off")
    if not 0 <= config.models.defaults.draft_max <= 64:
        errors.append("models.defaults.draft_max: must be 0 to 64")
    for origin in config.registry.image_origins:
        if not origin.startswith(("http://", "https://")):
            errors.append(f"registry.image_origins: {origin!r} is not an http(s) origin")
    residency = ("eager", "lazy", "pinned", "lazy_then_pin_resident")
    if config.models.weight_residency_default not in residency:
        errors.append(f"models.weight_residency_default: must be one of {', '.join(residency)}")
    try:
        parse_duration(config.models.default_keep_alive)
    except ValueError as exc:
        errors.append(f"models.default_keep_alive: {exc}")
    for name in ("root", "models", "pulls"):
        limits: SupervisorLimits = getattr(config.supervision, name)
        if limits.intensity < 0 or limits.period_s <= 0:
            errors.append(f"supervision.{name}: intensity >= 0 and period_s > 0 required")
    errors += _mcp_errors(config.mcp)
    if errors:
        raise ConfigError(f"{source}: " + "; ".join(errors))


_SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _mcp_errors(mcp: McpConfig) -> list[str]:
    errors: list[str] = []
    if not 1 <= mcp.max_rounds <= 64:
        errors.append("mcp.max_rounds: must be 1 to 64")
    if mcp.connect_timeout_s <= 0 or mcp.max_backoff_s <= 0:
        errors.append("mcp: connect_timeout_s and max_backoff_s must be positive")
    for name, server in mcp.servers.items():
        where = f"mcp.servers.{name}"
        if not _SERVER_NAME.match(name):
            errors.append(f"{where}: a name is 1-64 letters, digits, '_' or '-'")
        if bool(server.command) == bool(server.url):
            errors.append(f"{where}: set either command (stdio) or url (streamable HTTP)")
        if server.url and not server.url.startswith(("http://", "https://")):
            errors.append(f"{where}.url: must be an http(s) URL")
        if server.timeout_s <= 0 or server.max_concurrent < 1 or server.max_result_bytes < 256:
            errors.append(
                f"{where}: timeout_s > 0, max_concurrent >= 1, max_result_bytes >= 256 required"
            )
    return errors


def keep_alive_seconds(value: Any, default: str) -> float:
    """Ollama's keep_alive: seconds, a duration string, 0 = now, negative = forever;
    None = `default`. ValueError on anything else."""
    if value is None:
        return parse_duration(default)
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a number or a duration")
    if isinstance(value, int | float):
        return float(value)
    return parse_duration(str(value))
