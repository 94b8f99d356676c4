"""The known-sources catalog is data: it loads from the package, every enforcement rule maps to an
entry, its symptom fields are the ones the doctor knows, and a broken catalog file is refused with
the file and key named. The ranking is checked against facts as compare / verify-resume / localize
produce them (the end-to-end cases run real training in test_doctor / test_fixcheck / test_ladder)."""
from __future__ import annotations

import pytest

from megatron_bitdet.enforce.catalog import SYMPTOM_FIELDS, load_catalog
from megatron_bitdet.analysis.diagnose import WEIGHTS, diagnose, facts_from_scope, rank
from megatron_bitdet.enforce.rules import RULES
from megatron_bitdet.errors import BitdetInputError


def test_every_rule_maps_to_an_entry_and_fields_are_known():
    catalog = load_catalog()
    unmapped = [r.id for r in RULES if catalog.for_rule(r.id) is None]
    assert not unmapped, f"rules without a catalog entry: {unmapped}"
    assert set(WEIGHTS) == set(SYMPTOM_FIELDS)
    for e in catalog.entries:
        assert e.symptom and e.fix["kind"] in ("corrects", "works_around") and e.next.startswith("bitdet ")
        for rule in e.rules:
            assert rule in {r.id for r in RULES}, (e.id, rule)
    assert {c.kind for c in catalog.fix_changes} == {"corrects", "works_around"}


def test_scope_change_behind_a_recipe_digest_is_named_by_its_key():
    facts = facts_from_scope([{"key": "recipe_digest", "a": "x", "b": "y"}, {"key": "torch_threads", "a": 2, "b": 1}],
                             {"determinism": {"threads": 2}}, {"determinism": {"threads": 1}})
    assert facts["scope_keys"] == ["torch_threads", "recipe/determinism.threads"]
    d = diagnose(facts)
    assert d.top.id == "thread_count_scope" and "layout_scope" not in [c.id for c in d.causes]
    assert rank({"scope_keys": ["recipe/parallel.tensor", "tp"], "scope_keys_checked": True})[0].id == "layout_scope"


@pytest.mark.parametrize("text, where", [
    (b"version: 1\nentries: [\n", "known.yaml:3"),
    (b"\xff\xfe\x00garbage", "known.yaml"),
    (b"version: 2\nentries: []\n", "not a bitdet catalog"),
    (b"version: 1\nentries:\n  - {id: a, title: t, mechanism: m, next: n, fix: {change: c, kind: maybe}}\n",
     "entries[0].fix"),
    (b"version: 1\nentries:\n  - {id: a, title: t, mechanism: m, next: n, symptom: {colour: red},"
     b" fix: {change: c, kind: corrects}}\n", "entries[0].symptom.colour"),
    (b"version: 1\nentries: []\nfix_changes:\n  - {key: a.b, kind: corrects, what: one, two}\n",
     "fix_changes[0].two"),
])
def test_bad_catalog_is_refused_naming_file_and_key(tmp_path, text, where):
    path = tmp_path / "known.yaml"
    path.write_bytes(text)
    with pytest.raises(BitdetInputError, match=None) as exc:
        load_catalog(path)
    assert str(path) in str(exc.value) and where in str(exc.value)
