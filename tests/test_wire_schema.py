# tests/test_wire_schema.py - wire/messages.toml is the one declaration of the wire messages:
# the generated C and Python tables and docs/wire.md's layouts say what it says.
from __future__ import annotations

import dataclasses
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

from zz import wire, wire_table

# wire/gen.py, under a name of its own (tests/vectors/gen.py is `gen` to the vector tests)
_spec = importlib.util.spec_from_file_location(
    "wire_gen", Path(__file__).resolve().parents[1] / "wire" / "gen.py"
)
assert _spec and _spec.loader
gen = sys.modules["wire_gen"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def test_generated_tables_and_the_doc_match_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert gen.main(["--check"]) == 0, capsys.readouterr().err


def test_every_message_class_has_the_tables_fields() -> None:
    for mtype, (name, kinds, layout) in wire_table.MESSAGES.items():
        cls = wire.MESSAGE_TYPES[mtype]
        assert (cls.TYPE, cls.NAME, cls.AUTH) == (mtype, name, kinds[0])
        fields = [f.name for f in dataclasses.fields(cls)]
        assert fields == ["service", "sender", "auth"] + [f[0] for f in wire_table.LAYOUTS[layout]]
    assert wire.SignedRequest.AUTH in wire_table.MESSAGES[wire.Request.TYPE][1]


def _schema_with(change: str) -> dict:
    raw = tomllib.loads(gen.SCHEMA.read_text())
    msg = next(m for m in raw["messages"] if m["name"] == "FETCH")
    kind = msg["fields"][0]
    if change == "value too large":
        kind["values"] = [1, 2, 40]
    elif change == "values on bytes":
        msg["fields"].append({"name": "extra", "type": "bytes", "values": [1]})
    elif change == "unknown type":
        kind["type"] = "u24"
    elif change == "rule after a later field":
        msg["rules"] = [{"if": "kind", "in": [1], "field": "digest", "zero": True, "after": "kind"}]
    elif change == "zero on an integer":
        kind["zero"] = True
    elif change == "type number twice":
        msg["type"] = 10
    return raw


@pytest.mark.parametrize(
    "change",
    [
        "value too large",
        "values on bytes",
        "unknown type",
        "rule after a later field",
        "zero on an integer",
        "type number twice",
    ],
)
def test_the_generator_refuses_what_the_codecs_cannot_check(change: str) -> None:
    with pytest.raises(gen.SchemaError):
        gen.parse(_schema_with(change))


def test_the_doc_check_sees_a_wrong_layout_block() -> None:
    doc = gen.DOC.read_text()
    s = gen.load()
    assert gen.doc_problems(s, doc) == []
    wrong = doc.replace("u64 last_exec     highest seq executed", "u32 last_exec")
    assert wrong != doc
    assert any("STATUS" in p for p in gen.doc_problems(s, wrong))
