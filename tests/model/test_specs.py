"""Spec files: every default parses; every invalid input is one SpecError line naming the file
and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fa4aot.errors import SpecError
from fa4aot.model.specs import (
    DEFAULT_LAYOUTS,
    LAYOUTS,
    PHASES,
    Attention,
    Serving,
    Spec,
    default_spec_names,
    load_default,
    load_spec,
    parse_spec,
    resolve_specs,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = [
    "deepseek-v3", "gemma-4", "glm-4.7-flash", "gpt-oss-20b", "llama-3.1-70b", "llama-3.1-8b",
    "llama-3.1-8b-fp8",
    "mistral-7b", "qwen3-32b",
]

TINY = """
name = "tiny"
model = "org/tiny"

[[attention]]
name = "full"
num_q_heads = 8
num_kv_heads = 2
head_dim = 64

[serving]
tp = [1, 2]
layouts = ["dense", "paged"]
phases = ["decode"]
page_sizes = [16, "tile"]
"""


def test_default_spec_names():
    assert default_spec_names() == DEFAULTS


@pytest.mark.parametrize("name", DEFAULTS)
def test_every_default_spec_parses(name):
    s = load_default(name)
    assert s.name == name
    assert s.source == f"fa4aot/specs/{name}.toml"
    assert s.attention and all(isinstance(a, Attention) for a in s.attention)
    for a in s.attention:
        assert a.num_q_heads % a.num_kv_heads == 0
        for t in s.serving.tp:
            assert a.num_q_heads % t == 0
    assert set(s.serving.layouts) <= set(LAYOUTS) and set(s.serving.phases) <= set(PHASES)
    # the repo's specs/ directory is the package's: one set of files, two paths
    same = load_spec(REPO / "specs" / f"{name}.toml")
    assert same.identity() == s.identity()


def test_default_spec_contents():
    by = {s.name: s for s in resolve_specs(None)}
    assert sorted(by) == DEFAULTS
    llama = by["llama-3.1-8b"].attention[0]
    assert (llama.num_q_heads, llama.num_kv_heads, llama.head_dim, llama.head_dim_v) == (
        32,
        8,
        128,
        128,
    )
    assert by["llama-3.1-8b"].serving.return_lse == "both"
    assert all(a.sinks for a in by["gpt-oss-20b"].attention)
    assert [a.window for a in by["gpt-oss-20b"].attention] == [None, 128]
    gemma = {a.name: a for a in by["gemma-4"].attention}
    assert gemma["full"].head_dim == 512 and gemma["sliding"].window == 1024
    assert by["mistral-7b"].attention[0].window == 4096


def test_resolve_specs_by_name_and_path(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(TINY)
    got = resolve_specs(["mistral-7b", str(p)])
    assert [s.name for s in got] == ["mistral-7b", "tiny"]
    assert got[1].source == str(p)


def test_resolve_unknown_name_lists_defaults():
    with pytest.raises(SpecError) as e:
        resolve_specs(["no-such-model"])
    msg = str(e.value)
    assert "no-such-model" in msg and "llama-3.1-8b" in msg and "\n" not in msg


def test_resolve_missing_toml_path(tmp_path):
    with pytest.raises(SpecError, match="cannot read spec") as e:
        resolve_specs([str(tmp_path / "absent.toml")])
    assert "absent.toml" in str(e.value)


def test_defaults_of_a_minimal_spec():
    s = parse_spec('name = "m"\n[[attention]]\nnum_q_heads = 4\nnum_kv_heads = 4\nhead_dim = 96\n')
    assert s.model == "m"
    a = s.attention[0]
    assert a == Attention("layer0", 4, 4, 96, 96, "bfloat16", True, None, False)
    assert s.serving == Serving()
    assert s.serving.layouts == DEFAULT_LAYOUTS and s.serving.page_sizes == (128,)


def test_tiny_spec_values():
    s = parse_spec(TINY, "tiny.toml")
    assert s.serving.tp == (1, 2)
    assert s.serving.layouts == ("dense", "paged")
    assert s.serving.page_sizes == (16, "tile")
    assert s.serving.return_lse is False


# -- identity --------------------------------------------------------------------------------


def test_identity_is_canonical_json_and_stable():
    s = parse_spec(TINY, "a.toml")
    # golden: a change here changes every spec index already written to stores
    assert s.identity() == (
        '{"attention":[{"causal":true,"dtype":"bfloat16","head_dim":64,"head_dim_v":64,'
        '"name":"full","num_kv_heads":2,"num_q_heads":8,"sinks":false,"window":null}],'
        '"model":"org/tiny","name":"tiny","serving":{"decode_fold":true,"layouts":["dense","paged"],'
        '"max_batch":256,"max_context":32768,"page_sizes":[16,"tile"],"phases":["decode"],'
        '"return_lse":false,"speculative":1,"split_kv":true,"tp":[1,2]}}'
    )
    assert json.loads(s.identity()) == json.loads(json.dumps(s.to_dict()))
    assert "source" not in json.loads(s.identity())


def test_identity_equal_for_equal_specs_whatever_the_text():
    # other source file, key order, comments, explicit defaults: the same spec
    reordered = """
# a comment
model = "org/tiny"
name = "tiny"
[serving]
page_sizes = [16, "tile"]
phases = ["decode"]
layouts = ["dense", "paged"]
tp = [1, 2]
return_lse = false
[[attention]]
head_dim = 64
head_dim_v = 64
num_kv_heads = 2
num_q_heads = 8
name = "full"
causal = true
dtype = "bfloat16"
"""
    a, b = parse_spec(TINY, "a.toml"), parse_spec(reordered, "elsewhere/b.toml")
    assert a.source != b.source
    assert a.identity() == b.identity()
    assert a == Spec(b.name, b.model, b.attention, b.serving, a.source)


@pytest.mark.parametrize(
    "edit",
    [
        ("num_kv_heads = 2", "num_kv_heads = 4"),
        ("head_dim = 64", "head_dim = 128"),
        ('phases = ["decode"]', 'phases = ["decode", "prefill"]'),
        ('page_sizes = [16, "tile"]', "page_sizes = [16]"),
        ('model = "org/tiny"', 'model = "org/other"'),
    ],
)
def test_identity_changes_with_any_field(edit):
    old, new = edit
    assert old in TINY
    assert parse_spec(TINY).identity() != parse_spec(TINY.replace(old, new)).identity()


# -- validation: one line, file and field named ------------------------------------------------

BASE_ATT = 'name = "full"\nnum_q_heads = 32\nnum_kv_heads = 8\nhead_dim = 128\n'


def _spec(att: str = BASE_ATT, serving: str = "", top: str = 'name = "t"\n') -> str:
    return f"{top}\n[[attention]]\n{att}\n[serving]\n{serving}\n"


BAD = [
    # (id, text, field named in the message, words of the rule)
    ("invalid-toml", 'name = "t"\n[[attention]\n', "invalid TOML", ""),
    ("missing-name", _spec(top=""), "name", "required"),
    ("bad-name-chars", _spec(top='name = "a b"'), "name", "required"),
    ("model-not-string", _spec(top='name = "t"\nmodel = 3'), "model", "string"),
    ("no-attention", 'name = "t"\n', "attention", "at least one"),
    ("empty-attention", 'name = "t"\nattention = []\n', "attention", "at least one"),
    ("attention-not-table", 'name = "t"\nattention = [1]\n', "attention[0]", "table"),
    (
        "missing-q-heads",
        _spec(att="num_kv_heads = 8\nhead_dim = 128"),
        "attention[0].num_q_heads",
        "required",
    ),
    (
        "missing-kv-heads",
        _spec(att="num_q_heads = 8\nhead_dim = 128"),
        "attention[0].num_kv_heads",
        "required",
    ),
    (
        "missing-head-dim",
        _spec(att="num_q_heads = 8\nnum_kv_heads = 8"),
        "attention[0].head_dim",
        "required",
    ),
    (
        "heads-string",
        _spec(att=BASE_ATT.replace("num_q_heads = 32", 'num_q_heads = "32"')),
        "attention[0].num_q_heads",
        "integer",
    ),
    (
        "heads-bool",
        _spec(att=BASE_ATT.replace("num_q_heads = 32", "num_q_heads = true")),
        "attention[0].num_q_heads",
        "integer",
    ),
    (
        "heads-float",
        _spec(att=BASE_ATT.replace("num_q_heads = 32", "num_q_heads = 32.0")),
        "attention[0].num_q_heads",
        "integer",
    ),
    (
        "heads-zero",
        _spec(att=BASE_ATT.replace("num_kv_heads = 8", "num_kv_heads = 0")),
        "attention[0].num_kv_heads",
        "in [1, 1024]",
    ),
    ("causal-int", _spec(att=BASE_ATT + "causal = 1"), "attention[0].causal", "true or false"),
    ("sinks-string", _spec(att=BASE_ATT + 'sinks = "yes"'), "attention[0].sinks", "true or false"),
    (
        "sink-dtype-without-sinks",
        _spec(att=BASE_ATT + 'sink_dtype = "bfloat16"'),
        "attention[0].sink_dtype",
        "needs sinks = true",
    ),
    (
        "sink-dtype-fp8",
        _spec(att=BASE_ATT + 'sinks = true\nsink_dtype = "float8_e4m3fn"'),
        "attention[0].sink_dtype",
        "'float32', 'bfloat16', 'float16'",
    ),
    ("softcap-zero", _spec(att=BASE_ATT + "softcap = 0"), "attention[0].softcap", "> 0"),
    ("softcap-string", _spec(att=BASE_ATT + 'softcap = "30"'), "attention[0].softcap", "> 0"),
    (
        "kv-not-dividing",
        _spec(att=BASE_ATT.replace("num_kv_heads = 8", "num_kv_heads = 5")),
        "attention[0].num_kv_heads",
        "must divide num_q_heads (32)",
    ),
    (
        "head-dim-v-range",
        _spec(att=BASE_ATT + "head_dim_v = 2048"),
        "attention[0].head_dim_v",
        "in [1, 1024]",
    ),
    ("negative-window", _spec(att=BASE_ATT + "window = -1"), "attention[0].window", ">= 0"),
    (
        "unknown-dtype",
        _spec(att=BASE_ATT + 'dtype = "float32"'),
        "attention[0].dtype",
        "must be one of",
    ),
    (
        "layer-name-empty",
        _spec(att=BASE_ATT.replace('name = "full"', 'name = ""')),
        "attention[0].name",
        "non-empty",
    ),
    (
        "unknown-attention-key",
        _spec(att=BASE_ATT + "rope = 1"),
        "attention[0].rope",
        "unknown field",
    ),
    ("unknown-top-key", 'name = "t"\ncolor = "red"\n', "color", "unknown field"),
    ("unknown-serving-key", _spec(serving="batch = 4"), "serving.batch", "unknown field"),
    (
        "serving-not-table",
        'name = "t"\nserving = 3\n[[attention]]\n' + BASE_ATT,
        "serving",
        "table",
    ),
    (
        "duplicate-layers",
        f'name = "t"\n[[attention]]\n{BASE_ATT}\n[[attention]]\n{BASE_ATT}',
        "attention",
        "distinct",
    ),
    (
        "tp-not-dividing",
        _spec(serving="tp = [1, 3]"),
        "serving.tp",
        "3 does not divide full's 32 query heads",
    ),
    ("tp-empty", _spec(serving="tp = []"), "serving.tp", "non-empty list"),
    ("tp-not-list", _spec(serving="tp = 2"), "serving.tp", "non-empty list"),
    ("tp-duplicates", _spec(serving="tp = [2, 2]"), "serving.tp", "duplicates"),
    (
        "unknown-layout",
        _spec(serving='layouts = ["dense", "ragged"]'),
        "serving.layouts[1]",
        "must be one of",
    ),
    ("layouts-empty", _spec(serving="layouts = []"), "serving.layouts", "non-empty list"),
    (
        "unknown-phase",
        _spec(serving='phases = ["decode", "verify"]'),
        "serving.phases[1]",
        "must be one of",
    ),
    ("phases-empty", _spec(serving="phases = []"), "serving.phases", "non-empty list"),
    (
        "page-size-word",
        _spec(serving='page_sizes = [16, "tiles"]'),
        "serving.page_sizes[1]",
        "integer",
    ),
    ("page-size-zero", _spec(serving="page_sizes = [0]"), "serving.page_sizes[0]", "in [1, 4096]"),
    ("page-sizes-empty", _spec(serving="page_sizes = []"), "serving.page_sizes", "non-empty list"),
    (
        "page-sizes-dup-tile",
        _spec(serving='page_sizes = ["tile", "tile"]'),
        "serving.page_sizes",
        "duplicates",
    ),
    ("max-batch-zero", _spec(serving="max_batch = 0"), "serving.max_batch", "in [1, "),
    ("speculative-range", _spec(serving="speculative = 65"), "serving.speculative", "in [1, 64]"),
    ("lse-int", _spec(serving="return_lse = 1"), "serving.return_lse", "must be one of"),
    ("lse-word", _spec(serving='return_lse = "all"'), "serving.return_lse", "must be one of"),
]


@pytest.mark.parametrize("text,field,rule", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_invalid_spec_is_one_line_naming_file_and_field(tmp_path, text, field, rule):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{p}: "), msg
    assert f": {field}" in msg, msg
    assert rule in msg, msg


def test_spec_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_spec("name = 3")


def test_page_size_tile_is_accepted():
    s = parse_spec(_spec(serving='page_sizes = ["tile", 64]'))
    assert s.serving.page_sizes == ("tile", 64)


def test_return_lse_choices():
    for text, want in (("true", True), ("false", False), ('"both"', "both")):
        s = parse_spec(_spec(serving=f"return_lse = {text}"))
        assert s.serving.return_lse == want and type(s.serving.return_lse) is type(want)


def test_tp_above_kv_heads_replicates_kv():
    # 8 KV heads at TP16: each rank gets one replicated KV head; legal
    s = parse_spec(_spec(serving="tp = [1, 16]"))
    assert s.serving.tp == (1, 16)


def test_tp_splitting_kv_heads_unevenly_is_refused():
    # 24 query heads over 8 KV heads at TP3: 3 divides 24 but not 8 (and 8 KV heads cannot be
    # replicated evenly over 3 ranks): no engine shards this way
    att = BASE_ATT.replace("num_q_heads = 32", "num_q_heads = 24")
    with pytest.raises(
        SpecError, match=r"serving\.tp: 3 neither divides nor is a multiple of full.s 8 KV heads"
    ):
        parse_spec(_spec(att=att, serving="tp = [3]"), "x.toml")


def test_new_attention_fields_and_layouts():
    text = _spec(att=BASE_ATT + 'sinks = true\nsink_dtype = "float16"\nsoftcap = 30')
    text = text.replace("[serving]", '[serving]\nlayouts = ["padded", "batch+seqused/packed"]')
    s = parse_spec(text)
    a = s.attention[0]
    assert (a.sink_dtype, a.softcap) == ("float16", 30.0)
    assert s.serving.layouts == ("padded", "batch+seqused/packed")
    assert set(DEFAULT_LAYOUTS) < set(LAYOUTS)
    # left out of the identity only at their defaults
    d = s.to_dict()["attention"][0]
    assert (d["sink_dtype"], d["softcap"]) == ("float16", 30.0)
    with pytest.raises(SpecError, match="serving.layouts"):
        parse_spec(text.replace('"padded"', '"batch/nope"'))
