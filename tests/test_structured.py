"""OpenAI's `json_schema` response format becomes llama-cpp-python's JSON mode with that schema; a schema that no
grammar can express, or a malformed format, is refused naming the part (engine/structured.py)."""

from __future__ import annotations

import pytest

from primaplug.engine.structured import SchemaError, json_schema_format

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.mark.parametrize("strict", [True, False, None])
def test_a_json_schema_format_becomes_json_mode_with_its_schema(strict: bool | None) -> None:
    spec = {"name": "N", "schema": SCHEMA} | ({} if strict is None else {"strict": strict})
    assert json_schema_format({"type": "json_schema", "json_schema": spec}) == {"type": "json_object",
                                                                                "schema": SCHEMA}


@pytest.mark.parametrize("other", [None, {"type": "text"}, {"type": "json_object"},
                                   {"type": "json_object", "schema": SCHEMA}])
def test_other_formats_pass_as_they_are(other: object) -> None:
    assert json_schema_format(other) is other


@pytest.mark.parametrize(("schema", "part"), [({"not": {"type": "string"}}, "Unrecognized schema: {'not'"),
                                              ({"$ref": "https://example.com/s.json"}, "remote schemas"),
                                              ({"type": "tuple"}, "'tuple'")])
def test_a_schema_no_grammar_can_express_is_refused_naming_the_part(schema: dict, part: str) -> None:
    with pytest.raises(SchemaError, match="cannot express") as refused:
        json_schema_format({"type": "json_schema", "json_schema": {"name": "odd", "schema": schema}})
    assert part in str(refused.value) and "(odd)" in str(refused.value)


def test_a_malformed_json_schema_format_is_refused() -> None:
    with pytest.raises(SchemaError, match="'name' and a 'schema' object"):
        json_schema_format({"type": "json_schema", "json_schema": "no"})
