"""The manifest's JSON: what `Manifest.to_json` writes is the dataclass, field by field in order,
and reads back as the same manifest."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ckpt.errors import InvalidCheckpoint
from ckpt.format.manifest import FileEntry as F
from ckpt.format.manifest import Manifest, SaveCosts


def _manifest(**changes: object) -> Manifest:
    files = {
        "__1_0.distcp": F(96_000_000, "xxh3_64-blocks:0a", 1, 4 << 20, tuple(f"{i:016x}" for i in range(23))),
        "__0_0.distcp": F(95_000_000, "xxh3_64-blocks:0b", 0, 4 << 20, tuple(f"{i:016x}" for i in range(23))),
        ".metadata": F(9_876, "xxh3_64:ff", -1),
        'odd "name"\u00e9.bin': F(3, "xxh3_64:01", 0),
    }
    m = Manifest(
        step=12, world_size=2, created=1796094939.0183434, files=files, costs=SaveCosts(0.012, 1.5, 191_009_879),
        counters={"step": 12, "tokens": [1, 2.5], "nested": {"a": None}}, versions={"torch": "2.13.0"},
        user={"run": "r\u00fc\"n\n", "n": 1e300}, schedule={"policy": "auto", "seconds": 61.5},
    )  # fmt: skip
    return dataclasses.replace(m, **changes)


def _as_asdict_wrote_it(m: Manifest) -> dict:
    doc = dataclasses.asdict(m)
    if doc["signature"] is None:
        del doc["signature"]
    return json.loads(json.dumps(doc))  # tuples as lists, as any JSON reader sees them


def test_the_json_is_every_field_in_order_and_reads_back_the_same():
    for m in (_manifest(), _manifest(signature={"alg": "hmac-sha256", "key_id": "k", "mac": "00"}), Manifest(1, 1, 0.5, {})):
        raw = m.to_json()
        doc = json.loads(raw)
        assert doc == _as_asdict_wrote_it(m)
        assert list(doc) == list(_as_asdict_wrote_it(m))  # field order is the JSON order
        assert list(doc["files"]) == list(m.files)
        assert ("signature" in doc) == (m.signature is not None)
        assert Manifest.from_json(raw) == m
        assert raw.endswith(b"\n}\n")


def test_each_field_and_each_file_sits_on_a_line_of_its_own():
    m = _manifest()
    lines = m.to_json().decode().splitlines()
    for name in m.files:
        assert sum(line.startswith(f"  {json.dumps(name)}: {{") for line in lines) == 1, name
    for field in ("step", "world_size", "created", "files", "costs", "counters", "format", "format_version"):
        assert sum(line.startswith(f' "{field}": ') for line in lines) == 1, field


def test_the_document_shares_nothing_with_the_manifest():
    m = _manifest()
    doc = m.to_doc()
    doc["counters"]["nested"]["a"] = 1
    doc["user"]["n"] = 0
    doc["files"][".metadata"]["blocks"].append("x")
    doc["schedule"].clear()
    assert json.loads(m.to_json()) == _as_asdict_wrote_it(_manifest())


@pytest.mark.parametrize(
    "edit",
    [
        ("files", "__0_0.distcp", "rank", "0"),
        ("files", "__0_0.distcp", "size", "95000000"),
        ("files", "__0_0.distcp", "size", None),
        ("files", "__0_0.distcp", "size", -1),
        ("files", "__0_0.distcp", "block", 4.5),
        ("files", ".metadata", "rank", -2),
        ("step", None, None, "12"),
        ("step", None, None, 12.7),
        ("world_size", None, None, True),
        ("created", None, None, 1e300),
        ("created", None, None, "now"),
        ("costs", None, "bytes", "191009879"),
        ("costs", None, "persist_s", None),
    ],
    ids=str,
)
def test_a_field_of_the_wrong_type_is_an_invalid_manifest_not_a_crash_later(edit):
    """Listing, verifying and restoring do arithmetic on these fields: a hand-edited or forged
    manifest must be refused when read (the step is then corrupt), never fail somewhere later
    with a TypeError that stops the listing of every other step."""
    doc = json.loads(_manifest().to_json())
    top, name, key, value = edit
    if top == "files":
        doc["files"][name][key] = value
    elif key is not None:
        doc[top][key] = value
    else:
        doc[top] = value
    with pytest.raises(InvalidCheckpoint, match="unreadable manifest"):
        Manifest.from_json(json.dumps(doc).encode(), "m")
    assert Manifest.from_json(_manifest().to_json()) == _manifest()
