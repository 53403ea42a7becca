"""ConstraintSpec: what a request's output must match, as plain picklable data.

It crosses the process boundary on GenerateRequest, so it holds strings, never compiled
grammars (those are built in the engine, where the tokenizer lives).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_object", "json_schema", "tool_calls"]


@dataclass(frozen=True)
class ConstraintSpec:
    """kind:
    - "json_object": any JSON object (OpenAI JSON mode);
    - "json_schema": a JSON value valid against `schema` (a JSON string);
    - "tool_calls": like json_schema, with the schema built by the server from the request's
      tools (a call list, or one function's arguments); kept apart so logs and metrics can
      tell the two uses apart.
    """

    kind: Kind
    schema: str | None = None  # JSON text of the schema (a str keeps the dataclass hashable)

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "tool_calls"):
            raise ValueError(f"unknown constraint kind {self.kind!r}")
        if self.kind != "json_object" and self.schema is None:
            raise ValueError(f"a {self.kind} constraint needs a schema")

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | bool, kind: Kind = "json_schema"
    ) -> ConstraintSpec:
        return cls(kind, json.dumps(schema, sort_keys=True))

    def schema_value(self) -> dict[str, Any] | bool:
        """The schema to compile; JSON mode is the schema {"type": "object"}."""
        return {"type": "object"} if self.schema is None else json.loads(self.schema)
