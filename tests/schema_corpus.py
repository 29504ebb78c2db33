"""A corpus of JSON schemas as clients send them: pydantic models of everyday records
(orders, people, events, code, configuration), each in the forms the client libraries
generate — pydantic's own `model_json_schema()` (instructor, pydantic-ai), the openai
SDK's strict form (`.parse(response_format=Model)`), LangChain's tool parameters
(`with_structured_output`, `bind_tools`) — plus hand-written schemas with the keywords
generators rarely write (`$ref` chains, `oneOf`, `allOf`, formats, `patternProperties`,
conditionals, tuples). Each entry is (name, schema, how it is sent). Below them, how a
schema is asked and what its answer must be (bench/corpus.py runs the whole corpus
through Qwen; tests/test_structured_corpus.py reads what it recorded)."""

from __future__ import annotations

import datetime as dt
import enum
import json
import re
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import llguidance
from langchain_core.utils.function_calling import convert_to_openai_tool
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from barrel.pipeline.formats import json_schema_grammar


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Priority(enum.IntEnum):
    LOW = 1
    MEDIUM = 2
    HIGH = 3


class Address(BaseModel):
    street: str
    city: str
    postcode: Annotated[str, Field(pattern=r"^[0-9]{5}$")]
    country: Literal["FR", "DE", "US", "JP"]


class Person(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=40)]
    age: Annotated[int, Field(ge=0, le=120)]
    email: str | None = None


class Capital(BaseModel):
    country: str
    capital: str


class Weather(BaseModel):
    city: str
    celsius: float
    condition: Literal["sunny", "cloudy", "rain", "snow"]


class LineItem(BaseModel):
    sku: str
    quantity: Annotated[int, Field(ge=1, le=99)]
    unit_price: float


class Order(BaseModel):
    order_id: str
    customer: Person
    items: Annotated[list[LineItem], Field(min_length=1, max_length=3)]
    shipping: Address
    gift: bool = False


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: Annotated[float, Field(ge=0, le=1)]


class Entity(BaseModel):
    text: str
    kind: Literal["person", "place", "organisation", "date"]


class Entities(BaseModel):
    entities: Annotated[list[Entity], Field(max_length=4)]


class Task(BaseModel):
    title: str
    done: bool
    priority: Priority


class TodoList(BaseModel):
    owner: str
    tasks: Annotated[list[Task], Field(max_length=3)]


class Event(BaseModel):
    title: str
    starts: dt.datetime
    ends: dt.datetime | None = None
    attendees: Annotated[list[str], Field(max_length=3)] = []


class Meeting(BaseModel):
    day: dt.date
    topic: str
    room: int | None


class Ticket(BaseModel):
    id: uuid.UUID
    summary: str
    severity: Literal["minor", "major", "critical"]


class Paint(BaseModel):
    color: Color
    litres: float


class Book(BaseModel):
    title: str
    author: str
    year: Annotated[int, Field(ge=1450, le=2030)]
    isbn: Annotated[str, Field(pattern=r"^97[89][0-9]{10}$")] | None = None


class Library(BaseModel):
    name: str
    books: Annotated[list[Book], Field(max_length=2)]


class Recipe(BaseModel):
    name: str
    servings: int
    ingredients: Annotated[list[str], Field(min_length=2, max_length=5)]
    vegetarian: bool


class CodeReview(BaseModel):
    file: str
    line: int
    severity: Literal["nit", "warning", "error"]
    comment: str


class Review(BaseModel):
    comments: Annotated[list[CodeReview], Field(max_length=2)]
    approve: bool


class Function(BaseModel):
    name: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_]*$")]
    parameters: Annotated[list[str], Field(max_length=4)]
    returns: str


class SqlQuery(BaseModel):
    table: str
    columns: Annotated[list[str], Field(min_length=1, max_length=4)]
    where: str | None = None
    limit: Annotated[int, Field(ge=1, le=1000)] = 10


class HttpRequest(BaseModel):
    method: Literal["GET", "POST", "PUT", "DELETE"]
    path: Annotated[str, Field(pattern=r"^/[a-z0-9/_-]*$")]
    headers: dict[str, str] = {}


class Settings(BaseModel):
    debug: bool
    workers: Annotated[int, Field(ge=1, le=64)]
    log_level: Literal["debug", "info", "warning", "error"]
    timeout_s: float


class Product(BaseModel):
    name: str
    price: Annotated[float, Field(gt=0)]
    tags: Annotated[list[str], Field(max_length=3)]
    in_stock: bool


class Catalog(BaseModel):
    products: Annotated[list[Product], Field(min_length=1, max_length=2)]


class Coordinates(BaseModel):
    lat: Annotated[float, Field(ge=-90, le=90)]
    lon: Annotated[float, Field(ge=-180, le=180)]


class Place(BaseModel):
    name: str
    at: Coordinates
    kind: Literal["city", "mountain", "lake"]


class Translation(BaseModel):
    source_language: str
    target_language: str
    text: str


class Summary(BaseModel):
    title: str
    bullet_points: Annotated[list[str], Field(min_length=1, max_length=3)]


class Classification(BaseModel):
    category: Literal["bug", "feature", "question", "docs"]
    reasons: Annotated[list[str], Field(max_length=2)]


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    name: str
    animal: Annotated[Cat | Dog, Field(discriminator="kind")]


class Shape(BaseModel):
    shape: Literal["circle", "square"] | None
    size: int | float


class TreeNode(BaseModel):
    label: str
    children: Annotated[list[TreeNode], Field(max_length=2)] = []


class Employee(BaseModel):
    name: str
    role: str
    manager: Employee | None = None


class Invoice(BaseModel):
    number: str
    issued: dt.date
    lines: Annotated[list[LineItem], Field(min_length=1, max_length=2)]
    total: float
    currency: Literal["EUR", "USD", "JPY"]


class Answer(BaseModel):
    answer: str
    sources: Annotated[list[str], Field(max_length=2)]


class YesNo(BaseModel):
    verdict: bool
    why: str


class Score(BaseModel):
    score: Annotated[int, Field(ge=1, le=10)]


class Contact(BaseModel):
    person: Person
    address: Address | None
    phones: Annotated[list[Annotated[str, Field(pattern=r"^\+[0-9]{6,12}$")]], Field(max_length=2)]


class Step(BaseModel):
    explanation: str
    output: str


class MathReasoning(BaseModel):
    steps: Annotated[list[Step], Field(max_length=3)]
    final_answer: str


class Flight(BaseModel):
    origin: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]
    destination: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]
    passengers: Annotated[int, Field(ge=1, le=9)]
    cabin: Literal["economy", "business"]


class Pair(BaseModel):
    point: tuple[int, int]
    label: str


class Matrix(BaseModel):
    rows: Annotated[
        list[Annotated[list[int], Field(min_length=2, max_length=2)]],
        Field(min_length=2, max_length=2),
    ]


class Inventory(BaseModel):
    counts: dict[str, int]
    updated: dt.datetime


class Survey(BaseModel):
    respondent: str
    ratings: Annotated[list[Annotated[int, Field(ge=1, le=5)]], Field(min_length=3, max_length=3)]
    comment: str | None


MODELS: tuple[type[BaseModel], ...] = (
    Address, Person, Capital, Weather, LineItem, Order, Sentiment, Entities, TodoList, Event,
    Meeting, Ticket, Paint, Library, Recipe, Review, Function, SqlQuery, HttpRequest, Settings,
    Catalog, Place, Translation, Summary, Classification, Pet, Shape, TreeNode, Employee,
    Invoice, Answer, YesNo, Score, Contact, MathReasoning, Flight, Pair, Matrix, Inventory,
    Survey, Book, Task, Entity, Coordinates, Product, CodeReview, Step,
)  # fmt: skip

# Hand-written: keywords generators rarely produce, as real schemas have them.
HAND: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "ref chain",
        {
            "$defs": {
                "id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
                "node": {
                    "type": "object",
                    "properties": {"id": {"$ref": "#/$defs/id"}},
                    "required": ["id"],
                },
            },
            "type": "object",
            "properties": {"root": {"$ref": "#/$defs/node"}},
            "required": ["root"],
        },
    ),
    (
        "definitions (draft-07)",
        {
            "definitions": {"tag": {"type": "string", "maxLength": 10}},
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"$ref": "#/definitions/tag"}, "maxItems": 3}
            },
            "required": ["tags"],
        },
    ),
    (
        "anyOf types",
        {
            "type": "object",
            "properties": {
                "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}
            },
            "required": ["value"],
        },
    ),
    (
        "oneOf disjoint",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                    "required": ["kind", "x"],
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}},
                    "required": ["kind", "y"],
                },
            ]
        },
    ),
    (
        "allOf merge",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {
                    "type": "object",
                    "properties": {"b": {"type": "string", "maxLength": 5}},
                    "required": ["b"],
                },
            ]
        },
    ),
    (
        "type list",
        {"type": "object", "properties": {"n": {"type": ["integer", "null"]}}, "required": ["n"]},
    ),
    (
        "formats",
        {
            "type": "object",
            "properties": {
                "when": {"type": "string", "format": "date-time"},
                "day": {"type": "string", "format": "date"},
                "id": {"type": "string", "format": "uuid"},
                "mail": {"type": "string", "format": "email"},
                "ip": {"type": "string", "format": "ipv4"},
            },
            "required": ["when", "day", "id", "mail", "ip"],
        },
    ),
    (
        "time and duration",
        {
            "type": "object",
            "properties": {
                "at": {"type": "string", "format": "time"},
                "took": {"type": "string", "format": "duration"},
            },
            "required": ["at", "took"],
        },
    ),
    (
        "hostname and ipv6",
        {
            "type": "object",
            "properties": {
                "host": {"type": "string", "format": "hostname"},
                "v6": {"type": "string", "format": "ipv6"},
            },
            "required": ["host", "v6"],
        },
    ),
    (
        "uri format",
        {
            "type": "object",
            "properties": {"link": {"type": "string", "format": "uri"}},
            "required": ["link"],
        },
    ),
    (
        "additionalProperties schema",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    ),
    (
        "patternProperties",
        {
            "type": "object",
            "patternProperties": {"^x-[a-z]+$": {"type": "string"}},
            "additionalProperties": False,
        },
    ),
    (
        "minProperties",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "minProperties": 1,
        },
    ),
    (
        "enum mixed",
        {
            "type": "object",
            "properties": {"v": {"enum": [1, "two", None, True]}},
            "required": ["v"],
        },
    ),
    (
        "const object",
        {
            "type": "object",
            "properties": {"version": {"const": 2}, "name": {"type": "string", "maxLength": 10}},
            "required": ["version", "name"],
        },
    ),
    (
        "numbers bounded",
        {
            "type": "object",
            "properties": {
                "pct": {"type": "number", "minimum": 0, "maximum": 100},
                "odd": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            },
            "required": ["pct", "odd"],
        },
    ),
    (
        "multipleOf",
        {
            "type": "object",
            "properties": {
                "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}
            },
            "required": ["step"],
        },
    ),
    (
        "prefixItems tuple",
        {
            "type": "array",
            "prefixItems": [{"type": "string", "maxLength": 6}, {"type": "integer"}],
            "items": False,
        },
    ),
    (
        "array of arrays",
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
            "minItems": 1,
            "maxItems": 2,
        },
    ),
    (
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3},
    ),
    (
        "if then else",
        {
            "type": "object",
            "properties": {"kind": {"enum": ["a", "b"]}},
            "if": {"properties": {"kind": {"const": "a"}}},
            "then": {"required": ["x"]},
        },
    ),
    (
        "not",
        {"type": "object", "properties": {"v": {"not": {"type": "string"}}}, "required": ["v"]},
    ),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"card": {"type": "string"}, "cvv": {"type": "string"}},
            "dependentRequired": {"card": ["cvv"]},
        },
    ),
    (
        "contains",
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}, "maxItems": 3},
    ),
    (
        "remote ref",
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/schema.json"}}},
    ),
    (
        "boolean true schema",
        {"type": "object", "properties": {"anything": True}, "required": ["anything"]},
    ),
    ("empty object", {"type": "object", "properties": {}}),
    (
        "nullable string",
        {
            "type": "object",
            "properties": {"s": {"type": "string", "nullable": True, "maxLength": 5}},
            "required": ["s"],
        },
    ),
    (
        "description heavy",
        {
            "type": "object",
            "description": "A labelled thing.",
            "title": "Thing",
            "properties": {
                "label": {
                    "type": "string",
                    "description": "its label",
                    "examples": ["x"],
                    "default": "x",
                    "maxLength": 12,
                }
            },
            "required": ["label"],
        },
    ),
    (
        "deep nesting",
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {
                        "b": {
                            "type": "object",
                            "properties": {
                                "c": {
                                    "type": "object",
                                    "properties": {"d": {"type": "integer"}},
                                    "required": ["d"],
                                }
                            },
                            "required": ["c"],
                        }
                    },
                    "required": ["b"],
                }
            },
            "required": ["a"],
        },
    ),
    (
        "recursive list",
        {
            "$defs": {
                "item": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 8},
                        "sub": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 1},
                    },
                    "required": ["name"],
                }
            },
            "$ref": "#/$defs/item",
        },
    ),
    (
        "string lengths",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3}},
            "required": ["code"],
        },
    ),
    (
        "pattern with classes",
        {
            "type": "object",
            "properties": {"plate": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}-[A-Z]{2}$"}},
            "required": ["plate"],
        },
    ),
    (
        "unanchored pattern",
        {
            "type": "object",
            "properties": {"word": {"type": "string", "pattern": "[a-z]+ing", "maxLength": 12}},
            "required": ["word"],
        },
    ),
    ("top-level string", {"type": "string", "maxLength": 20}),
    ("top-level enum", {"enum": ["yes", "no", "maybe"]}),
    ("top-level integer", {"type": "integer", "minimum": 1, "maximum": 9}),
    (
        "top-level array",
        {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
)

Corpus = list[tuple[str, dict[str, Any], str]]  # (name, schema, "format" | "tool")


def corpus() -> Corpus:
    """Every schema with the way it is sent: as the response format, or as the
    parameters of a forced tool call (LangChain's form is a tool's)."""
    out: Corpus = []
    for model in MODELS:
        name = model.__name__
        out.append((f"{name} (pydantic)", model.model_json_schema(), "format"))
        out.append((f"{name} (openai strict)", to_strict_json_schema(model), "format"))
        tool = convert_to_openai_tool(model)["function"]
        out.append((f"{name} (langchain tool)", tool["parameters"], "tool"))
    out += [(name, schema, "format") for name, schema in HAND]
    out += [
        (f"{name} (tool)", schema, "tool")
        for name, schema in HAND
        if schema.get("type") == "object"
    ]
    return out


# -- how a schema is asked, and what its answer must be --------------------------------------

# Features llguidance does not implement, as its refusals name them (a 400 must name one):
# an unimplemented keyword, a remote reference, a schema nothing satisfies. ("not" alone
# would also match "does not exist", a reference Barrel failed to carry.)
UNSUPPORTED = re.compile(
    r'Unimplemented keys: \[.*"(uniqueItems|if|then|not|dependentRequired|contains)"'
    r"|Resource '[^']*' is not present|unsatisfiable",
    re.I,
)
ASK = "Give one short example that fits. Keep strings to a few words and lists to one or two items."
ANSWERS = Path(__file__).parent / "data" / "corpus_answers.json"


def request(schema: dict[str, Any], how: str, model: str = "qwen") -> dict[str, Any]:
    """The chat completion that asks for a document of `schema`, as a client asks."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": ASK}],
        "temperature": 0,
        "max_tokens": 1000,
    }
    if how == "format":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema},
        }
    else:
        body["tools"] = [{"type": "function", "function": {"name": "fill", "parameters": schema}}]
        body["tool_choice"] = "required"
    return body


def answer_text(response: dict[str, Any], how: str) -> str:
    """The document an answer holds, as text: the content, or the call's arguments."""
    message = response["choices"][0]["message"]
    if how == "format":
        return str(message["content"])
    (call,) = message["tool_calls"]
    return str(call["function"]["arguments"])


def a_prefix(text: str, schema: dict[str, Any]) -> bool:
    """Whether `text` is the start of a document the schema's grammar accepts (read
    byte by byte by llguidance)."""
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, json_schema_grammar(schema))
    tokens = tokenizer.tokenize_bytes(text.encode())
    return bool(matcher.try_consume_tokens(tokens) == len(tokens) and not matcher.is_error())


def check(name: str, schema: dict[str, Any], how: str, status: int, body: dict[str, Any]) -> str:
    """What is wrong with one answer ("" when nothing is): a 400 names an unsupported
    feature, a 200 holds a document of the schema, or, cut at max_tokens, the start of
    one."""
    if status == 400:
        message = str(body["error"]["message"])
        return "" if UNSUPPORTED.search(message) else f"{name}: refused: {message}"
    if status != 200:
        return f"{name}: {status} {json.dumps(body)[:200]}"
    if body["choices"][0]["finish_reason"] == "length":
        text = body["choices"][0]["message"]["content"] if how == "format" else ""
        return "" if how != "format" or a_prefix(text, schema) else f"{name}: cut off the schema"
    try:
        jsonschema.validate(json.loads(answer_text(body, how)), schema)
    except (ValueError, KeyError, jsonschema.ValidationError) as exc:
        return f"{name} ({how}): {str(exc)[:200]}"
    return ""
