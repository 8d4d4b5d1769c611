"""The types of input columns: a kept column's Arrow type over its values (``TypeOf``), kept
in the job manifest as text, and the kind of a column's values that hints are chosen by."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

INFER_ROWS = 4096  # JSONL values of a kept column typed together, then unified


class TypeOf:
    """A kept column's type over its values: pyarrow's inference per chunk, unified permissively
    (null -> int64 -> double ...); types that do not unify make it JSON text."""

    def __init__(self, type_: pa.DataType | None = None) -> None:
        self.type, self.json, self.values = type_, False, []

    def add(self, value: Any) -> None:
        if not self.json:
            self.values.append(value)
            if len(self.values) >= INFER_ROWS:
                self.settle()

    def merge(self, other: pa.DataType) -> None:
        if self.json or self.type == other:
            return
        if self.type is None:
            self.type = other
            return
        try:
            schemas = [pa.schema([("x", self.type)]), pa.schema([("x", other)])]
            self.type = pa.unify_schemas(schemas, promote_options="permissive").field("x").type
        except (pa.ArrowException, TypeError, ValueError):
            self.json = True

    def settle(self) -> None:
        if self.values and not self.json:
            try:
                self.merge(pa.array(self.values).type)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                self.json = True
        self.values = []


def type_to_text(type_: pa.DataType) -> str:
    return pa.schema([("x", type_)]).serialize().to_pybytes().hex()


def type_from_text(text: str) -> pa.DataType:
    return pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(text))).field("x").type


def value_kind(value: Any) -> str:
    """The kind of a JSON value, for hints: "text", "number", "bool", "list", "object", "null"."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "list" if isinstance(value, list) else "object"


def arrow_kind(type_: pa.DataType) -> str:
    """``value_kind`` of a Parquet column's type."""
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return "text"
    if pa.types.is_integer(type_) or pa.types.is_floating(type_):
        return "number"
    if pa.types.is_boolean(type_):
        return "bool"
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return "list"
    return "null" if pa.types.is_null(type_) else "object"
