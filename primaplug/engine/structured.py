"""OpenAI's Structured Outputs (`response_format: {"type": "json_schema", "json_schema": {...}}`) on llama-cpp-python.

llama-cpp-python knows JSON mode with a schema (`{"type": "json_object", "schema": ...}`), which it turns into a
grammar that constrains every sampled token; its types and its server refuse `json_schema`, what today's OpenAI
clients send (`client.beta.chat.completions.parse`, agent frameworks). `json_schema_format` translates one into the
other. Where the grammar converter cannot express the schema, llama-cpp-python silently falls back to any JSON; with
`json_schema` the caller asked for that schema, so this refuses instead, naming the part it cannot express.
"""

from __future__ import annotations

import json
from typing import Any

from llama_cpp.llama_grammar import json_schema_to_gbnf

from primaplug.core.errors import SchemaError


def json_schema_format(response_format: Any) -> Any:
    """llama-cpp-python's `json_object` format with the schema of a `json_schema` one (strict or not: the grammar
    constrains every token either way); any other format as it is."""
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return response_format
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise SchemaError("response_format.json_schema must be an object with a 'name' and a 'schema' object, as "
                          "OpenAI's Structured Outputs send it")
    schema = spec.get("schema") or {"type": "object"}
    try:
        json_schema_to_gbnf(json.dumps(schema))
    except (AssertionError, ValueError, KeyError, TypeError, NotImplementedError) as e:
        what = str(e).strip() or type(e).__name__
        raise SchemaError(f"response_format.json_schema.schema ({spec.get('name', 'unnamed')}): the grammar converter "
                          f"cannot express this part of the schema: {what}. Simplify that part, or use "
                          f"{{\"type\": \"json_object\"}} for any JSON") from None
    return {"type": "json_object", "schema": schema}
