"""Recipe schema: file:line:key errors (all at once), extends, overrides, digest, shipped recipes."""
import json
import os
import subprocess
import sys

import pytest

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.recipe import Recipe, RecipeError, load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "nemotron_h_tiny.yaml")
DATA = os.path.join(ROOT, "tests", "data", "recipes")


def _errors(path, overrides=()):
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return info.value.lines


def _line_of(path, text):
    with open(path) as fh:
        return next(i for i, line in enumerate(fh, 1) if text in line)


@pytest.mark.parametrize("name", ["nemotron_h_tiny", "nemotron_h_8b", "nemotron3_nano"])
def test_shipped_recipes_validate(name):
    recipe = load_recipe(os.path.join(ROOT, "recipes", f"{name}.yaml"))
    assert recipe.name == name
    assert recipe.model.num_layers == len(recipe.model.hybrid_pattern)


def test_tiny_recipe_attributes_keep_yaml_names():
    r = load_recipe(TINY)
    assert (r.model.num_layers, r.model.mamba.state_dim, r.parallel.expert) == (6, 16, 2)
    assert r.model.moe.router_fusion is False and r.determinism.fill_uninitialized_memory is False
    assert r.determinism.swaps is True


def test_nemotron_shapes_from_upstream_notes():
    h8b = load_recipe(os.path.join(ROOT, "recipes", "nemotron_h_8b.yaml"))
    assert (h8b.model.num_layers, h8b.model.hidden_size, h8b.model.ffn_hidden_size) == (52, 4096, 21504)
    assert (h8b.model.mamba.num_heads, h8b.model.mamba.head_dim, h8b.model.mamba.state_dim) == (128, 64, 128)
    nano = load_recipe(os.path.join(ROOT, "recipes", "nemotron3_nano.yaml"))
    assert (nano.model.hidden_size, nano.model.num_query_groups, nano.model.moe.num_experts) == (2688, 2, 128)
    assert (nano.model.moe.top_k, nano.model.moe.shared_expert_ffn_hidden_size) == (6, 3712)


def test_typo_names_file_line_and_key_with_suggestion():
    path = os.path.join(DATA, "typo_key.yaml")
    (line,) = _errors(path)
    assert line == f"{path}:{_line_of(path, 'num_expert:')}: model.moe.num_expert: unknown key (did you mean num_experts?)"


def test_all_errors_reported_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodel:\n  hybrid_pattern: 'M*X'\n  hidden_size: 64\n  ffn_hidden_size: abc\n"
                   "  num_attention_heads: 4\n  seq_length: 64\n  vocab_size: 256\n  spec: tee\n"
                   "training:\n  seed: -1\n  lr_schedule: {style: cosin}\n")
    lines = _errors(str(bad))
    assert lines == [
        f"{bad}:3: model.hybrid_pattern: symbols ['X'] not supported; allowed: M (Mamba-2), * (attention), "
        "- (MLP), E (MoE)",
        f"{bad}:5: model.ffn_hidden_size: expected an integer, got 'abc'",
        f"{bad}:9: model.spec: 'tee' is not allowed; allowed: auto, local, te (did you mean te?)",
        f"{bad}:11: training.seed: -1 is out of range: must be >= 0",
        f"{bad}:12: training.lr_schedule.style: 'cosin' is not allowed; allowed: cosine, linear, constant "
        "(did you mean cosine?)",
    ]


@pytest.mark.parametrize("override, expected", [
    ("model.num_attention_heads=3", "model.num_attention_heads: 3 does not divide model.hidden_size (64)"),
    ("model.num_query_groups=3", "model.num_query_groups: 3 does not divide model.num_attention_heads (4)"),
    ("model.moe.top_k=5", "model.moe.top_k: 5 exceeds moe.num_experts (4)"),
    ("model.moe.num_experts=0", "model.moe.num_experts: the pattern has MoE layers (E) but moe.num_experts is 0"),
    ("training.micro_batch_size=3", "training.micro_batch_size: 3 does not divide training.global_batch_size (8)"),
    ("parallel.expert=3", "parallel.expert: 3 does not divide model.moe.num_experts (4)"),
    ("parallel.tensor=8", "parallel.tensor: 8 does not divide model.num_attention_heads (4)"),
    ("model.mamba.num_groups=3", "model.mamba.num_groups: 3 does not divide mamba.num_heads (4)"),
    ("data.split=98,1", "data.split: '98,1' must be three non-negative integers 'train,valid,test'"),
])
def test_derived_checks_name_the_override(override, expected):
    assert _errors(TINY, [override])[0] == f"<override {override!r}>: {expected}"


def test_errors_in_a_base_name_the_base_file():
    path = os.path.join(DATA, "child_of_bad_base.yaml")
    base = os.path.join(DATA, "bad_base.yaml")
    assert _errors(path) == [
        f"{base}:{_line_of(base, 'normalisation')}: model.normalisation: unknown key (did you mean normalization?)",
        f"{path}:{_line_of(path, 'micro_batch_size')}: training.micro_batch_size: 2 does not divide "
        "training.global_batch_size (7)",
    ]


def test_extends_merges_child_over_base_and_errors_name_the_right_file():
    r = load_recipe(os.path.join(DATA, "router_fusion.yaml"))
    assert r.model.moe.router_fusion is True and r.model.moe.num_experts == 4  # rest from the base
    assert r.where("model", "moe", "router_fusion").endswith("router_fusion.yaml:7")
    assert r.where("model", "moe", "num_experts") == f"{TINY}:{_line_of(TINY, 'num_experts:')}"


def test_overrides_are_parsed_as_yaml_and_validated():
    r = load_recipe(TINY, ["model.hidden_size=128", "determinism.opt_out=[moe_router_fusion]",
                           "model.moe={num_experts: 8, top_k: 2, ffn_hidden_size: 32}", "data.cache_dir=null"])
    assert r.model.hidden_size == 128 and r.determinism.opt_out == ("moe_router_fusion",)
    assert r.model.moe.num_experts == 8 and r.model.moe.router_score_function == "softmax"  # replaced section
    assert r.data.cache_dir is None
    assert _errors(TINY, ["model.hidden_size=abc", "training.nope=1", "novalue", "model.hidden_size.x=1"]) == [
        "<override 'novalue'>: expected key.path=value (e.g. model.hidden_size=128)",
        "<override 'model.hidden_size.x=1'>: model.hidden_size is 'abc', not a mapping",
        "<override 'model.hidden_size=abc'>: model.hidden_size: expected an integer, got 'abc'",
        "<override 'training.nope=1'>: training.nope: unknown key; allowed: iterations, micro_batch_size, "
        "global_batch_size, seed, log_interval, optimizer, lr_schedule",
    ]


def test_yaml_syntax_duplicate_keys_and_missing_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nmodel:\n  hidden_size: [1, 2\n")
    (line,) = _errors(str(broken))
    assert line.startswith(f"{broken}:") and "invalid YAML" in line
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: x\nname: y\n")
    assert f"{dup}:2: name: duplicate key" in _errors(str(dup))
    with pytest.raises(BitdetInputError, match="cannot read recipe"):
        load_recipe(str(tmp_path / "absent.yaml"))


def test_extends_cycle_is_an_input_error(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    (line,) = _errors(str(tmp_path / "a.yaml"))
    assert "extends: cycle" in line


def test_digest_is_canonical_and_from_dict_round_trips():
    a, b = load_recipe(TINY), load_recipe(TINY)
    assert a.digest() == b.digest() and a.digest().startswith("sha256:")
    assert load_recipe(TINY, ["training.seed=1235"]).digest() != a.digest()
    again = Recipe.from_dict(json.loads(json.dumps(a.to_dict())), source="manifest.json")
    assert again == a and again.digest() == a.digest()
    broken = a.to_dict()
    broken["model"]["moe"]["top_k"] = "two"
    with pytest.raises(RecipeError, match=r"manifest.json: model.moe.top_k: expected an integer"):
        Recipe.from_dict(broken, source="manifest.json")


def _bitdet(*args):
    return subprocess.run([sys.executable, "-m", "megatron_bitdet", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_cli_show_and_typo_exit_codes():
    shown = _bitdet("recipe", "show", TINY, "model.hidden_size=128")
    assert shown.returncode == 0, shown.stderr
    assert "hidden_size: 128" in shown.stdout and "extends" not in shown.stdout
    path = os.path.join(DATA, "typo_key.yaml")
    typo = _bitdet("recipe", "validate", path)
    assert typo.returncode == 2
    assert f"{path}:{_line_of(path, 'num_expert:')}: model.moe.num_expert: unknown key" in typo.stderr
    assert "Traceback" not in typo.stderr
    helped = _bitdet("recipe", "validate", "--help")
    assert helped.returncode == 0 and "examples:" in helped.stdout


@pytest.mark.parametrize("command", ["recipe validate", "train"])
@pytest.mark.parametrize("junk", [b"\xff\xfe", b"\x00", b"\xc3("])
def test_non_utf8_or_unprintable_recipe_exits_2_naming_file_and_line(tmp_path, capsys, command, junk):
    from megatron_bitdet.cli import main

    text = open(TINY, "rb").read()
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(text.replace(b"hidden_size: 64", b"hidden_size: 6" + junk + b"4", 1))
    line = text[:text.index(b"hidden_size: 64")].count(b"\n") + 1
    args = ["train", "--recipe", str(bad), "--nproc", "2", "--run-dir", str(tmp_path / "run")] \
        if command == "train" else ["recipe", "validate", str(bad)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{bad}:{line}: " in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_fp4_and_fp8_together_are_refused_naming_the_fp4_key():
    """A linear computes in one low-precision format (megatron-core refuses fp4 with fp8 too)."""
    path = os.path.join(ROOT, "recipes", "nemotron_h_tiny_fp4.yaml")
    assert load_recipe(path).model.fp4.recipe == "nvfp4"
    lines = _errors(path, ["model.fp8.recipe=delayed"])
    assert len(lines) == 1 and "model.fp4.recipe" in lines[0] and "model.fp8.recipe: delayed" in lines[0]
