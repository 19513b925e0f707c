"""Bounded constraints (every string, number and array has a limit), so a random-weight
model must finish them within max_tokens, and validators for their outputs."""
from __future__ import annotations

import json
import re

import jsonschema

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["a", "b", "c"]}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "unit": {"enum": ["c", "f"]}}}
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["red", "green", "blue"]


def valid_json(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), "not compact"
    return value


def valid_regex(text: str, pattern: str = REGEX) -> str:
    assert re.fullmatch(pattern, text), text
    return text
