"""Structured-output validity over a set of varied JSON Schemas, against any OpenAI-compatible
server (dyn, llama.cpp's llama-server, vLLM), with the official `openai` client: each schema is
sent as `response_format: json_schema`, and each answer checked by `jsonschema` (Draft 2020-12,
formats checked).

The schemas come from two sources: hand-written ones covering what applications use (nesting,
enums, arrays with bounds, anyOf/oneOf, string formats and patterns, numeric bounds, const,
nullable fields, $defs references), and the JSON Schemas pydantic generates for typical models
(Optional, Literal, nested models, constrained types, unions, datetimes) in the strict form the
openai client sends for `chat.completions.parse`.

Usage: schemas.py BASE_URL MODEL [CONCURRENCY] [MAX_TOKENS]. Prints one JSON line per schema
({"source", "name", "valid", "finish", "tokens", "error"}) and a summary line last.
"""
import datetime
import enum
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Optional, Union

import jsonschema
from openai import OpenAI
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field, conint, constr


def s(props, required=None, **kw):
    """An object schema with these properties (all required unless said)."""
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


STR = {"type": "string", "maxLength": 24}
HANDWRITTEN = {
    "person": s({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enum_color": s({"color": {"enum": ["red", "green", "blue"]}}),
    "bool_flag": s({"ok": {"type": "boolean"}, "reason": STR}),
    "number_bounds": s({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    "exclusive_bounds": s({"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "array_bounded": s({"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}}),
    "array_of_objects": s({"items": {"type": "array", "maxItems": 3,
                                     "items": s({"sku": STR, "qty": {"type": "integer", "minimum": 1, "maximum": 99}})}}),
    "nested_two": s({"user": s({"id": {"type": "integer"}, "profile": s({"bio": STR})})}),
    "nested_three": s({"a": s({"b": s({"c": {"type": "string", "maxLength": 8}})})}),
    "anyof_scalar": s({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}}),
    "anyof_objects": s({"shape": {"anyOf": [
        s({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0, "maximum": 100}}),
        s({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0, "maximum": 100}})]}}),
    "oneof_const": s({"status": {"oneOf": [{"const": "active"}, {"const": "inactive"}]}}),
    "nullable": s({"middle_name": {"type": ["string", "null"], "maxLength": 12}}),
    "optional_fields": s({"title": STR, "subtitle": STR, "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
                         required=["title"]),
    "date_format": s({"when": {"type": "string", "format": "date"}}),
    "datetime_format": s({"at": {"type": "string", "format": "date-time"}}),
    "time_format": s({"at": {"type": "string", "format": "time"}}),
    "email_format": s({"email": {"type": "string", "format": "email", "maxLength": 40}}),
    "uuid_format": s({"id": {"type": "string", "format": "uuid"}}),
    "pattern_phone": s({"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}}),
    "pattern_code": s({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    "string_lengths": s({"word": {"type": "string", "minLength": 3, "maxLength": 8}}),
    "const_version": s({"version": {"const": 2}, "name": STR}),
    "enum_mixed": s({"level": {"enum": [1, 2, 3, "max"]}}),
    "array_numbers": s({"values": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
                                   "minItems": 2, "maxItems": 4}}),
    "tuple_prefix": s({"point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}],
                                 "items": False, "minItems": 2}}),
    "unique_small": s({"dice": {"type": "array", "items": {"enum": [1, 2, 3, 4, 5, 6]}, "maxItems": 2}}),
    "defs_ref": {"$defs": {"addr": s({"street": STR, "city": STR})},
                 **s({"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}})},
    "top_level_array": {"type": "array", "items": s({"k": STR, "v": {"type": "integer"}}), "minItems": 1, "maxItems": 2},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "integer_multiple": s({"n": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}}),
    "map_like": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
                 "maxProperties": 3},
    "recipe": s({"title": STR, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                 "ingredients": {"type": "array", "maxItems": 4, "items": s({"name": STR, "grams": {"type": "integer", "minimum": 1, "maximum": 999}})},
                 "vegan": {"type": "boolean"}}),
    "event": s({"name": STR, "date": {"type": "string", "format": "date"},
                "attendees": {"type": "array", "items": {"type": "string", "format": "email", "maxLength": 30}, "maxItems": 2}}),
    "weather_call": s({"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}),
}

# Source two: what pydantic writes for ordinary application models.


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class City(BaseModel):
    name: constr(max_length=24)
    population: conint(ge=0, le=50_000_000)


class Address(BaseModel):
    street: constr(max_length=24)
    zip: constr(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    name: constr(max_length=24)
    address: Address
    vip: bool


class Order(BaseModel):
    id: uuid.UUID
    items: list[City] = Field(max_length=2)
    total: float = Field(ge=0, le=10_000)


class Reading(BaseModel):
    unit: Unit
    value: float = Field(ge=-100, le=100)


class Meeting(BaseModel):
    title: constr(max_length=24)
    start: datetime.datetime
    minutes: conint(ge=5, le=240)


class Birthday(BaseModel):
    who: constr(max_length=24)
    day: datetime.date


class Flag(BaseModel):
    enabled: bool
    note: Optional[constr(max_length=20)] = None


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: float = Field(ge=0, le=1)


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    name: constr(max_length=16)


class Owner(BaseModel):
    name: constr(max_length=16)
    pets: list[Pet] = Field(max_length=2)


class Money(BaseModel):
    amount: conint(ge=0, le=1_000_000)
    currency: Literal["EUR", "USD", "JPY"]


class Either(BaseModel):
    value: Union[conint(ge=0, le=9), constr(max_length=8)]


class Review(BaseModel):
    stars: conint(ge=1, le=5)
    text: constr(max_length=40)
    tags: list[constr(max_length=10)] = Field(max_length=3)


class Task(BaseModel):
    title: constr(max_length=24)
    done: bool
    due: Optional[datetime.date] = None


class TodoList(BaseModel):
    owner: constr(max_length=16)
    tasks: list[Task] = Field(min_length=1, max_length=2)


class Point(BaseModel):
    x: float = Field(ge=-10, le=10)
    y: float = Field(ge=-10, le=10)


class Line(BaseModel):
    start: Point
    end: Point


class Book(BaseModel):
    title: constr(max_length=24)
    year: conint(ge=1450, le=2030)
    isbn: constr(pattern=r"^[0-9]{13}$")


class Library(BaseModel):
    books: list[Book] = Field(max_length=2)


class Login(BaseModel):
    user: constr(min_length=3, max_length=12)
    email: constr(max_length=40, pattern=r"^[a-z]+@[a-z]+\.[a-z]{2,3}$")


class Version(BaseModel):
    major: conint(ge=0, le=99)
    minor: conint(ge=0, le=99)
    label: Optional[Literal["alpha", "beta", "rc"]] = None


class Coordinates(BaseModel):
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)


class Place(BaseModel):
    name: constr(max_length=24)
    at: Coordinates
    kind: Literal["city", "park", "museum"]


class Survey(BaseModel):
    answers: list[Answer] = Field(min_length=1, max_length=3)


# As the openai client sends a pydantic model (`chat.completions.parse`): its strict form, every
# field required and no other properties.
PYDANTIC = {m.__name__: to_strict_json_schema(m) for m in (
    City, Address, Customer, Order, Reading, Meeting, Birthday, Flag, Answer, Pet, Owner, Money,
    Either, Review, Task, TodoList, Point, Line, Book, Library, Login, Version, Coordinates,
    Place, Survey)}


def run(client, model, source, name, schema, max_tokens):
    started = time.time()
    try:
        r = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0.7, seed=1,
            messages=[{"role": "user", "content": f"Give an example {name.replace('_', ' ')} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": name[:60], "schema": schema}},
        )
    except Exception as e:  # noqa: BLE001 - a refused schema is a result too
        return {"source": source, "name": name, "valid": False, "finish": None, "tokens": 0,
                "error": f"{type(e).__name__}: {str(e)[:200]}"}
    text = r.choices[0].message.content or ""
    error = None
    try:
        jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    except Exception as e:  # noqa: BLE001 - any failure is an invalid answer
        error = f"{type(e).__name__}: {str(e)[:160]} in {text[:120]!r}"
    return {"source": source, "name": name, "valid": error is None,
            "finish": r.choices[0].finish_reason, "tokens": r.usage.completion_tokens,
            "seconds": round(time.time() - started, 2), "error": error}


def main():
    url, model = sys.argv[1], sys.argv[2]
    concurrency = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 384
    client = OpenAI(base_url=url, api_key="unused", timeout=600)
    jobs = [("handwritten", n, sc) for n, sc in HANDWRITTEN.items()]
    jobs += [("pydantic", n, sc) for n, sc in PYDANTIC.items()]
    started = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda j: run(client, model, *j, max_tokens), jobs))
    wall = time.time() - started
    for r in results:
        print(json.dumps(r), flush=True)
    valid = sum(r["valid"] for r in results)
    cut = sum(r["finish"] == "length" for r in results)
    tokens = sum(r["tokens"] for r in results)
    print(json.dumps({"summary": True, "schemas": len(results), "valid": valid,
                      "validity": valid / len(results), "cut_by_max_tokens": cut,
                      "sources": sorted({r["source"] for r in results}),
                      "tokens": tokens, "seconds": round(wall, 1),
                      "tok_s": round(tokens / wall, 1)}))


if __name__ == "__main__":
    main()
