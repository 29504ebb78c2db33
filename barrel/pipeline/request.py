"""The neutral request every dialect's codec decodes into: frozen msgspec structs, with
content parts as a tagged union (text and images), and no dialect-shaped dicts inside.
`barrel.pipeline.generation` turns one into a generation. A leaf: it imports nothing of
Barrel, so the codecs load without llama.cpp.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

import msgspec


class Dialect(StrEnum):
    """The wire language a request speaks: its defaults (barrel.pipeline.sampling) and
    its error envelope (barrel.http.errors) follow it. BARREL: Barrel's own endpoints,
    which generate nothing."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    OLLAMA = "ollama"
    BARREL = "barrel"


Role = Literal["system", "user", "assistant", "tool"]


class TextPart(msgspec.Struct, frozen=True, tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag="image"):
    """An image: its bytes (data URLs, base64 blocks) or a URL to fetch. Models with a
    projector read it (barrel.pipeline.images); others refuse it with a 400."""

    data: bytes = b""
    url: str = ""
    media_type: str = ""
    digest: str = ""  # the bytes' SHA-256 (hex), set once by barrel.pipeline.images.load


class AudioPart(msgspec.Struct, frozen=True, tag="audio"):
    """An audio clip: its base64 text as the client sent it (decoded off the event loop
    by barrel.pipeline.audio.load) or its bytes, and the format the client named (wav,
    mp3, flac; the bytes' header decides). Models whose projector takes audio read it."""

    data: bytes = b""
    encoded: str = ""
    format: str = ""
    digest: str = ""  # the bytes' SHA-256 (hex), set once by barrel.pipeline.audio.load
    seconds: float = 0.0  # the clip's length, set with the digest


Part = TextPart | ImagePart | AudioPart


class ToolCall(msgspec.Struct, frozen=True):
    """A call the assistant made: `arguments` is the parsed JSON value (an object)."""

    id: str
    name: str
    arguments: Any = msgspec.field(default_factory=dict)


class Message(msgspec.Struct, frozen=True, kw_only=True):
    role: Role
    parts: tuple[Part, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""  # a tool result: the call it answers
    name: str = ""  # a tool result: the tool's name, when the dialect gives it
    reasoning: str = ""  # an assistant turn's thinking, passed back

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(p for p in self.parts if isinstance(p, ImagePart))

    @property
    def audio(self) -> tuple[AudioPart, ...]:
        return tuple(p for p in self.parts if isinstance(p, AudioPart))

    @property
    def media(self) -> tuple[ImagePart | AudioPart, ...]:
        """Images and audio clips: what the model's projector reads."""
        return tuple(p for p in self.parts if isinstance(p, ImagePart | AudioPart))


def text(role: Role, content: str) -> Message:
    return Message(role=role, parts=(TextPart(content),) if content else ())


class Tool(msgspec.Struct, frozen=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})


class ToolChoice(msgspec.Struct, frozen=True):
    """auto | none | required | function (then `name`, and `server` when the client
    named the tool server that offers it: OpenAI's MCP tool choice)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str = ""
    server: str = ""


class Format(msgspec.Struct, frozen=True):
    """The answer's shape: free text, any JSON object, JSON matching `schema`, text
    matching the regular expression `text`, one of `choices`, or the Lark or GBNF
    grammar `text` (barrel.pipeline.formats)."""

    kind: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"] = "text"
    schema: dict[str, Any] | None = None
    text: str = ""
    choices: tuple[str, ...] = ()

    @property
    def json(self) -> bool:
        """The answer is a JSON document (a reasoning model's thinking comes first)."""
        return self.kind in ("json_object", "json_schema")


class ServerUse(msgspec.Struct, frozen=True):
    """A configured tool server the request lets the model use (barrel.pipeline.
    servertools): by the name the configuration gives it; `url`, when the dialect sends
    one, must be the configured one; `tools` narrows what it offers (None: all)."""

    name: str
    url: str = ""
    tools: tuple[str, ...] | None = None


class Options(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The sampling fields a request set (None: not set; the model's and the dialect's
    defaults fill them in). Names are llama.cpp's / Ollama's."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dry_multiplier: float | None = None
    num_predict: int | None = None
    stop: tuple[str, ...] | None = None

    def given(self) -> dict[str, Any]:
        """The fields the request set, by name."""
        out = msgspec.structs.asdict(self)
        return {k: (list(v) if k == "stop" else v) for k, v in out.items() if v is not None}


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt without a chat template: OpenAI's completions, Ollama's `raw` prompt and
    its `suffix`. Each prompt (text or token ids) is completed as it is given, the answer
    unparsed text (barrel.pipeline.complete), and run `n` times: run index = prompt * n +
    choice."""

    prompts: tuple[str | tuple[int, ...], ...]
    suffix: str = ""  # fill-in-the-middle: the text after the answer
    # when neither the request nor the model sets max_tokens: OpenAI's 16; None (Ollama's)
    # until the end of generation or a full context
    default_max_tokens: int | None = 16
    echo: bool = False  # each prompt in front of its answers
    prompt_logprobs: bool = False  # score the prompt: each token's logprob (with echo)


class ApiRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    dialect: Dialect
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    # configured tool servers whose tools the model may call; Barrel runs those calls
    servers: tuple[ServerUse, ...] = ()
    format: Format = Format()
    options: Options = Options()
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    logprobs: int | None = None  # None: off; N: the chosen token and the top N
    max_tokens: int | None = None  # None: the model's num_predict, else no limit
    stop: tuple[str, ...] = ()  # stop strings added to those of the options and the model
    n: int = 1  # choices, each its own engine sequence
    stream: bool = False
    keep_alive: float | None = None  # seconds; None: the configured default
    # thinking: None lets the template decide; `reasoning_effort` reaches the template
    # and sets the budget (EFFORT_BUDGETS) unless `reasoning_budget` does
    thinking: bool | None = None
    reasoning_effort: str | None = None
    reasoning_budget: int | None = None
    template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    # the KV session: a conversation id (header, prompt_cache_key) and a user id
    conversation: str | None = None
    user: str | None = None
    # whose request it is (an API key's hash, set by the server; "" without keys): KV
    # cells and cached-token counts stay within it
    scope: str = ""
    # pin the prompt up to the end of this many request messages (a cache breakpoint)
    pin_messages: int = 0
    # llama-server's per-request LoRA: (adapter id, scale) pairs; adapters not named get
    # scale 0. None: the model's adapters at their load-time scales.
    lora: tuple[tuple[int, float], ...] | None = None
    ignore_eos: bool = False  # generate past end-of-generation tokens, up to max_tokens
    # vLLM's and llama-server's: the template's generation prompt (false: the prompt ends
    # where the messages do), or the final assistant message left open and continued
    generation_prompt: bool = True
    continue_final: bool = False
    # a prompt longer than the context is cut to fit, its oldest tokens after the first
    # few dropped (Ollama's way), instead of refused
    truncate: bool = False
    context: tuple[int, ...] = ()  # Ollama's: an earlier answer's tokens, before the prompt
    completion: Completion | None = None  # no chat template (then `messages` is empty)

    @property
    def runs(self) -> int:
        """Engine sequences the request takes: n for each prompt."""
        return self.n * (len(self.completion.prompts) if self.completion is not None else 1)
