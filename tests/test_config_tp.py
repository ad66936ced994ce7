"""The ``tensor_parallel`` config block: defaults, every source, the layer-spec records and
their errors, the world-size check, ``explain``/``reference``, and the import of DeepSpeed's
AutoTP section. Single process, no distributed run."""

from __future__ import annotations

import json

import pytest
import yaml

from mixprec import Accelerator
from mixprec.cli import main
from mixprec.config import (
    ConfigError,
    MixprecConfig,
    TensorParallelOptions,
    TPLayerSpec,
    TPPartitionConfig,
    config_to_dict,
    resolve,
)
from mixprec.config.importers import import_config
from mixprec.config.reference import reference_markdown

SPECS = "tensor_parallel.partition_config.layer_specs"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MIXPREC_CONFIG_FILE", "WORLD_SIZE", "MIXPREC_TENSOR_PARALLEL_SIZE",
                 "MIXPREC_TENSOR_PARALLEL_PRESET_MODEL"):
        monkeypatch.delenv(name, raising=False)


def _resolve(config=None, env=None, world_size=1, **kw):
    return resolve(config, env=env or {}, world_size=world_size, **kw)


def _tp(layer_specs, **partition):
    return {"tensor_parallel": {"size": 2, "partition_config": {"layer_specs": layer_specs, **partition}}}


def test_defaults():
    r = _resolve()
    tp = r.config.tensor_parallel
    assert isinstance(tp, TensorParallelOptions) and isinstance(tp.partition_config, TPPartitionConfig)
    assert (tp.size, tp.preset_model) == (1, None)
    assert tp.partition_config.use_default_specs is True and tp.partition_config.layer_specs == ()
    assert r.source("tensor_parallel.size") == "default"
    assert "tensor_parallel" not in config_to_dict(r.config)


def test_dict_gives_the_block_and_builds_the_specs():
    r = _resolve({"tensor_parallel": {"size": 4, "preset_model": "qwen2", "partition_config": {
        "use_default_specs": False,
        "layer_specs": [
            {"patterns": [r"\.qkv_proj$"], "partition_type": "column", "shape": [[16, 8, 8], -1],
             "partition_dim": 0, "model_types": ["qwen2"]},
            {"patterns": ["o_proj$", "down_proj$"], "partition_type": "row"},
            TPLayerSpec(patterns=("gate$",), partition_type="skip"),
        ]}}}, world_size=8)
    tp = r.config.tensor_parallel
    assert (tp.size, tp.preset_model, tp.partition_config.use_default_specs) == (4, "qwen2", False)
    qkv, o, gate = tp.partition_config.layer_specs
    assert qkv == TPLayerSpec(patterns=(r"\.qkv_proj$",), partition_type="column", shape=((16, 8, 8), -1),
                              partition_dim=0, model_types=("qwen2",))
    assert (o.patterns, o.partition_type, o.shape, o.partition_dim, o.model_types) == \
        (("o_proj$", "down_proj$"), "row", None, None, ())
    assert gate.partition_type == "skip"
    assert r.source(SPECS) == "config dict"
    # Written back as plain YAML, entries with their required and non-default keys only.
    written = config_to_dict(r.config)["tensor_parallel"]["partition_config"]["layer_specs"]
    assert written[1] == {"patterns": ["o_proj$", "down_proj$"], "partition_type": "row"}
    assert written[0]["shape"] == [[16, 8, 8], -1]
    assert _resolve(config_to_dict(r.config), world_size=8).config == r.config


def test_yaml_file(tmp_path):
    f = tmp_path / "mixprec.yaml"
    f.write_text(
        "tensor_parallel:\n  size: 2\n  preset_model: llama\n  partition_config:\n"
        "    use_default_specs: false\n    layer_specs:\n"
        "      - patterns: ['.*qkv_proj$']\n        partition_type: column\n        shape: [[16, 8, 8], -1]\n"
        "      - {patterns: ['.*o_proj$'], partition_type: row}\n")
    r = _resolve(str(f), world_size=4)
    tp = r.config.tensor_parallel
    assert (tp.size, tp.preset_model) == (2, "llama") and r.source("tensor_parallel.size") == f"file {f}"
    assert [s.partition_type for s in tp.partition_config.layer_specs] == ["column", "row"]
    assert tp.partition_config.layer_specs[0].shape == ((16, 8, 8), -1)


def test_config_object_and_accelerator(tmp_path):
    cfg = MixprecConfig(tensor_parallel=TensorParallelOptions(size=2, preset_model="gpt2"))
    r = _resolve(cfg)
    assert r.config.tensor_parallel.size == 2 and r.source("tensor_parallel.preset_model") == "config object"
    # One process cannot split over 2 ranks: the error names both numbers (the multi-process
    # runs are in tests/distributed/test_tensor_parallel.py).
    from mixprec.parallel.mesh import MeshError

    with pytest.raises(MeshError, match=r"tensor_parallel.size=2 does not divide the world size 1"):
        Accelerator(config={"tensor_parallel": {"size": 2}}, cpu=True, log_policy=False)
    f = tmp_path / "m.yaml"
    f.write_text("tensor_parallel:\n  size: 1\n  partition_config:\n    layer_specs:\n"
                 "      - {patterns: [o_proj$], partition_type: row}\n")
    acc = Accelerator(config=str(f), cpu=True, log_policy=False)
    assert acc.config.config.tensor_parallel.partition_config.layer_specs[0].patterns == ("o_proj$",)
    assert acc.mesh is None and acc.tp_plan == {}


def test_env_vars_and_conflicts():
    r = _resolve(env={"MIXPREC_TENSOR_PARALLEL_SIZE": "2", "MIXPREC_TENSOR_PARALLEL_PRESET_MODEL": "mixtral",
                      "MIXPREC_TENSOR_PARALLEL_PARTITION_CONFIG_USE_DEFAULT_SPECS": "false"}, world_size=4)
    tp = r.config.tensor_parallel
    assert (tp.size, tp.preset_model, tp.partition_config.use_default_specs) == (2, "mixtral", False)
    assert r.source("tensor_parallel.size") == "env MIXPREC_TENSOR_PARALLEL_SIZE"
    with pytest.raises(ConfigError, match=r"tensor_parallel.size='two' must be an int >= 1 "
                                          r"\(from env MIXPREC_TENSOR_PARALLEL_SIZE\)"):
        _resolve(env={"MIXPREC_TENSOR_PARALLEL_SIZE": "two"})
    with pytest.raises(ConfigError, match=r"'tensor_parallel.size' is given twice with different values: 4 by "
                                          r"config dict and 2 by env MIXPREC_TENSOR_PARALLEL_SIZE"):
        _resolve({"tensor_parallel": {"size": 4}}, env={"MIXPREC_TENSOR_PARALLEL_SIZE": "2"})
    with pytest.raises(ConfigError, match=r"MIXPREC_TENSOR_PARALLEL_SIZ='2' is not a mixprec config variable\. "
                                          r"Did you mean MIXPREC_TENSOR_PARALLEL_SIZE\?"):
        _resolve(env={"MIXPREC_TENSOR_PARALLEL_SIZ": "2"})
    # layer_specs from an env var: YAML/JSON text.
    r = _resolve(env={"MIXPREC_TENSOR_PARALLEL_PARTITION_CONFIG_LAYER_SPECS":
                      '[{"patterns": ["o_proj$"], "partition_type": "row"}]'})
    assert r.config.tensor_parallel.partition_config.layer_specs == (
        TPLayerSpec(patterns=("o_proj$",), partition_type="row"),)
    with pytest.raises(ConfigError, match=rf"{SPECS}='\[\{{' must be a YAML/JSON list of mappings"):
        _resolve(env={"MIXPREC_TENSOR_PARALLEL_PARTITION_CONFIG_LAYER_SPECS": "[{"})


@pytest.mark.parametrize("block,message", [
    ({"size": 0}, r"tensor_parallel.size=0 must be an int >= 1 \(from config dict\)"),
    ({"size": 2.0}, r"tensor_parallel.size=2.0 must be an int >= 1"),
    ({"preset_model": "phi3"}, r"tensor_parallel.preset_model='phi3' is not supported; use one of 'llama', "
                               r"'qwen2', 'mixtral', 'deepseek_v2', 'gpt2'"),
    ({"preset_model": "qwen"}, r"Did you mean 'qwen2'\?"),
    ({"presets": "llama"}, r"unknown config key 'tensor_parallel.presets' \(from config dict\)\. Did you mean "
                           r"'preset_model'\? Valid keys in block 'tensor_parallel': size, preset_model, "
                           r"partition_config"),
    ({"partition_config": {"use_default_spec": True}},
     r"unknown config key 'tensor_parallel.partition_config.use_default_spec'.*Did you mean 'use_default_specs'\?"),
    ({"partition_config": {"use_default_specs": "yes"}},
     r"tensor_parallel.partition_config.use_default_specs='yes' must be true or false"),
    ({"partition_config": {"layer_specs": {"patterns": ["x"]}}},
     rf"{SPECS}=\{{'patterns': \['x'\]\}} must be a list of mappings with keys patterns, partition_type, "
     r"shape, partition_dim, model_types"),
    ({"partition_config": 3}, r"config key 'tensor_parallel.partition_config' \(from config dict\) must be a "
                              r"block of keys \(use_default_specs, layer_specs\), got 3"),
])
def test_block_errors(block, message):
    with pytest.raises(ConfigError, match=message):
        _resolve({"tensor_parallel": block})


@pytest.mark.parametrize("spec,message", [
    ({"pattern": ["x"], "partition_type": "row"},
     rf"unknown key 'pattern' in {SPECS}\[1\] \(from config dict\)\. Did you mean 'patterns'\? Valid keys of an "
     r"entry: patterns, partition_type, shape, partition_dim, model_types"),
    ({"partition_type": "row"},
     rf"{SPECS}\[1\] has no 'patterns' \(from config dict\): add patterns: <a non-empty list of regular "
     r"expressions \(Python re\)> \(required keys of an entry: patterns, partition_type\)"),
    ({"patterns": ["x"]}, rf"{SPECS}\[1\] has no 'partition_type'.*add partition_type: <one of 'column', 'row', "
                          r"'skip'>"),
    ({"patterns": [], "partition_type": "row"},
     rf"{SPECS}\[1\].patterns=\[\] must be a non-empty list of regular expressions \(Python re\): the list is "
     r"empty"),
    ({"patterns": "o_proj", "partition_type": "row"},
     rf"{SPECS}\[1\].patterns='o_proj' must be a non-empty list of regular expressions"),
    ({"patterns": ["ok$", "(q_proj"], "partition_type": "row"},
     rf"{SPECS}\[1\].patterns=\['ok\$', '\(q_proj'\] must be a non-empty list of regular expressions \(Python "
     r"re\): '\(q_proj' does not compile \(missing \), unterminated subpattern at position 0\) \(fix or escape"),
    ({"patterns": ["x"], "partition_type": "col"},
     rf"{SPECS}\[1\].partition_type='col' is not supported; use one of 'column', 'row', 'skip' \(from config "
     r"dict\)\. Did you mean 'column'\?"),
    ({"patterns": ["x"], "partition_type": "row", "shape": [[16, "kv"], -1]},
     rf"{SPECS}\[1\].shape=\[\[16, 'kv'\], -1\] must be null or a list of dims, each an int >= 1, -1 \(the "
     r"whole dim\) or a list of ints >= 1"),
    ({"patterns": ["x"], "partition_type": "row", "shape": [0, -1]}, rf"{SPECS}\[1\].shape=\[0, -1\] must be"),
    ({"patterns": ["x"], "partition_type": "row", "shape": [[], -1]}, rf"{SPECS}\[1\].shape=\[\[\], -1\] must be"),
    ({"patterns": ["x"], "partition_type": "row", "shape": "2,-1"}, rf"{SPECS}\[1\].shape='2,-1' must be"),
    ({"patterns": ["x"], "partition_type": "row", "partition_dim": 2},
     rf"{SPECS}\[1\].partition_dim=2 must be null, 0 or 1"),
    ({"patterns": ["x"], "partition_type": "row", "model_types": "llama"},
     rf"{SPECS}\[1\].model_types='llama' must be a list of strings"),
    ("o_proj$", rf"{SPECS}\[1\]='o_proj\$' must be a mapping with keys patterns, partition_type, shape, "
                r"partition_dim, model_types \(from config dict\); required: patterns, partition_type"),
])
def test_layer_spec_errors_name_the_entry_the_key_and_the_fix(spec, message):
    good = {"patterns": ["o_proj$"], "partition_type": "row"}
    with pytest.raises(ConfigError, match=message):
        _resolve(_tp([good, spec]))


def test_layer_spec_errors_from_a_file(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("tensor_parallel:\n  partition_config:\n    layer_specs:\n"
                 "      - {patterns: ['[a-'], partition_type: row}\n")
    with pytest.raises(ConfigError, match=rf"{SPECS}\[0\].patterns=\['\[a-'\] must be .*'\[a-' does not compile "
                                          rf"\(unterminated character set at position 0\).*\(from file {f}\)"):
        _resolve(str(f))


def test_world_size_must_be_a_multiple_of_the_group_size():
    for world in (2, 4, 8):
        assert _resolve({"tensor_parallel": {"size": 2}}, world_size=world).config.tensor_parallel.size == 2
    assert _resolve({"tensor_parallel": {"size": 2}}, world_size=1).config.tensor_parallel.size == 2  # unlaunched
    assert _resolve({"tensor_parallel": {"size": 1}}, world_size=3).config.tensor_parallel.size == 1
    with pytest.raises(ConfigError, match=r"tensor_parallel.size=4 \(from config dict\) does not divide the world "
                                          r"size 6: .* Run a multiple of tensor_parallel.size processes, or "
                                          r"change tensor_parallel.size"):
        _resolve({"tensor_parallel": {"size": 4}}, world_size=6)
    with pytest.raises(ConfigError, match=r"tensor_parallel.size=4 \(from env MIXPREC_TENSOR_PARALLEL_SIZE\) does "
                                          r"not divide the world size 2"):
        _resolve(env={"MIXPREC_TENSOR_PARALLEL_SIZE": "4", "WORLD_SIZE": "2"}, world_size=None)


def test_explain_and_flags_show_the_block(tmp_path, capsys):
    f = tmp_path / "m.yaml"
    f.write_text("tensor_parallel:\n  size: 2\n  partition_config:\n    layer_specs:\n"
                 "      - {patterns: ['.*qkv_proj$'], partition_type: column, shape: [[16, 8, 8], -1]}\n")
    assert main(["config", "explain", str(f)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.split("precision per backend")[0]
             .splitlines() if line.strip()}
    assert lines["tensor_parallel.size"].split()[1:] == ["2", "file", str(f)]
    assert lines["tensor_parallel.preset_model"].split()[1:] == ["null", "default"]
    assert ("[{patterns: [.*qkv_proj$], partition_type: column, shape: [[16, 8, 8], -1]}]"
            in lines[SPECS])
    out = tmp_path / "w.yaml"
    assert main(["config", "--tensor-parallel-size", "4", "--tensor-parallel-preset-model", "gpt2",
                 "--tensor-parallel-partition-config-layer-specs", "[{patterns: [dense$], partition_type: row}]",
                 "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == {"tensor_parallel": {
        "size": 4, "preset_model": "gpt2",
        "partition_config": {"layer_specs": [{"patterns": ["dense$"], "partition_type": "row"}]}}}


def test_reference_documents_the_block_and_its_entries():
    text = reference_markdown()
    for key in ("`tensor_parallel.size`", "`MIXPREC_TENSOR_PARALLEL_SIZE`", "`tensor_parallel.preset_model`",
                "`tensor_parallel.partition_config.use_default_specs`", f"`{SPECS}`",
                f"Each entry of `{SPECS}`", "| `patterns` | a non-empty list of regular expressions (Python re) "
                "| `required` |", "| `partition_dim` | null, 0 or 1 | `null` |"):
        assert key in text, key


DS_TP = {
    "autotp_size": 2,
    "preset_model": "llama",
    "partition_config": {
        "use_default_specs": False,
        "layer_specs": [
            {"patterns": [".*qkv_proj$"], "partition_type": "column", "shape": [[16, 8, 8], -1]},
            {"patterns": [".*o_proj$"], "partition_type": "row"},
        ],
    },
}


def test_import_deepspeed_tensor_parallel(tmp_path, capsys):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                               "tensor_parallel": DS_TP}))
    out = tmp_path / "m.yaml"
    assert main(["config", "import", str(src), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    for line in ("tensor_parallel.autotp_size = 2", "-> tensor_parallel.size: 2",
                 "tensor_parallel.preset_model = llama", "-> tensor_parallel.preset_model: llama",
                 "tensor_parallel.partition_config.use_default_specs = false",
                 "-> tensor_parallel.partition_config.use_default_specs: false",
                 f"-> {SPECS}: [{{patterns: [.*qkv_proj$], partition_type: column, shape: [[16, 8, 8], -1]}}, "
                 "{patterns: [.*o_proj$], partition_type: row}]"):
        assert line in err, line
    assert yaml.safe_load(out.read_text()) == {
        "backend": "zero1", "mixed_precision": "bf16",
        "tensor_parallel": {"size": 2, "preset_model": "llama", "partition_config": {
            "use_default_specs": False,
            "layer_specs": [{"patterns": [".*qkv_proj$"], "partition_type": "column", "shape": [[16, 8, 8], -1]},
                            {"patterns": [".*o_proj$"], "partition_type": "row"}]}}}
    tp = resolve(str(out), env={}, world_size=4).config.tensor_parallel
    assert tp.size == 2 and tp.preset_model == "llama" and tp.partition_config.use_default_specs is False
    assert tp.partition_config.layer_specs == (
        TPLayerSpec(patterns=(".*qkv_proj$",), partition_type="column", shape=((16, 8, 8), -1)),
        TPLayerSpec(patterns=(".*o_proj$",), partition_type="row"))


def test_import_deepspeed_tensor_parallel_spellings_and_patterns(tmp_path):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"tensor_parallel": {
        "tp": {"tp_size": 4, "tp_grain_size": 64, "mpu": None},
        "preset_model": "Qwen2",
        "partition_config": {"layer_specs": [
            {"patterns": [".*\\.o_proj\\.weight$", "lm_head"], "partition_type": "ROW"},
            {"patterns": [".*\\.gate_up_proj\\.weight$"], "shape": [2, -1], "partition_dim": 0},
        ]}}}))
    report = import_config(str(src))
    assert report.kind == "DeepSpeed" and not report.refused, report.text()
    tp = report.config["tensor_parallel"]
    assert (tp["size"], tp["preset_model"]) == (4, "qwen2")
    row, gate_up = tp["partition_config"]["layer_specs"]
    # DeepSpeed: re.match on '<module>.weight'; mixprec: re.search on '<module>'.
    assert row == TPLayerSpec(patterns=(r".*\.o_proj$", "^lm_head"), partition_type="row")
    assert gate_up == TPLayerSpec(patterns=(r".*\.gate_up_proj$",), partition_type="column", shape=(2, -1),
                                  partition_dim=0)
    text = report.text()
    assert "tensor_parallel.tp.tp_size = 4" in text and "-> tensor_parallel.size: 4" in text
    assert r"[0] .*\.o_proj\.weight$ -> .*\.o_proj$, lm_head -> ^lm_head" in text
    assert "entries 1: partition_type column, DeepSpeed's default" in text
    src.write_text(json.dumps({"tensor_parallel": {"tp_size": 2}}))
    assert import_config(str(src)).config == {"tensor_parallel": {"size": 2}}


def test_import_deepspeed_tensor_parallel_report(tmp_path):
    """Keys with no meaning for mixprec are ignored with a reason; unknown or unsupported ones
    are refused one by one, bad entries with the schema's error."""
    src = tmp_path / "ds.json"
    section = {
        "autotp_size": 2, "tp_overlap_comm": True, "keep_module_on_host": False,
        "injection_policy_tuple": None, "dtype": "bf16", "tp_grain_size": 64, "mpu": None,
        "replace_with_kernel_inject": False,
        "partition_config": {
            "tp_size": 2, "strict_mode": False, "lm_head_patterns": ["lm_head", "embed_out"],
            "embedding_partition_dim": 0, "frobnicate": 1,
            "layer_specs": [
                {"patterns": ["o_proj$"], "partition_type": "row", "gather_output": False, "extra": 1},
                {"patterns": ["(bad"], "partition_type": "row"},
                {"patterns": ["q_proj$"], "partition_type": "column", "grad_allreduce": True},
                {"patterns": ["x$"], "partition_type": "diagonal"},
            ]},
        "tp_sizes": 2,
    }
    src.write_text(json.dumps({"train_batch_size": 8, "tensor_parallel": section}))
    report = import_config(str(src))
    outcomes = dict(report.lines)
    for key in ("tp_overlap_comm", "keep_module_on_host", "injection_policy_tuple", "dtype", "tp_grain_size", "mpu",
                "replace_with_kernel_inject"):
        hit = [o for line, o in report.lines if line.startswith(f"tensor_parallel.{key} = ")]
        assert hit and hit[0].startswith("ignored: ") and len(hit[0]) > len("ignored: ") + 2, key
    assert outcomes["tensor_parallel.partition_config.tp_size = 2"].startswith("ignored: DeepSpeed replaces it")
    assert outcomes["tensor_parallel.partition_config.strict_mode = false"] == "ignored: DeepSpeed's default"
    assert outcomes[f"{SPECS}[0].gather_output = false"] == "ignored: off"
    assert set(report.refused) == {
        "tensor_parallel.partition_config.embedding_partition_dim", "tensor_parallel.partition_config.frobnicate",
        f"{SPECS}[0].extra", f"{SPECS}[1]", f"{SPECS}[2].grad_allreduce", f"{SPECS}[3]", "tensor_parallel.tp_sizes"}
    assert "REFUSED: unknown tensor_parallel key" in outcomes["tensor_parallel.tp_sizes = 2"]
    bad = [o for line, o in report.lines if line.startswith(f"{SPECS}[1] = ")][0]
    assert "'^(bad' does not compile" in bad  # the pattern as rewritten for re.search
    bad = [o for line, o in report.lines if line.startswith(f"{SPECS}[3] = ")][0]
    assert "partition_type='diagonal' is not supported; use one of 'column', 'row', 'skip'" in bad
    # The entries that convert are kept (without their refused keys), in order.
    specs = report.config["tensor_parallel"]["partition_config"]["layer_specs"]
    assert [s.patterns for s in specs] == [("^o_proj$",), ("^q_proj$",)]
    assert "4 key(s) REFUSED" not in report.text() and "7 key(s) REFUSED" in report.text()


@pytest.mark.parametrize("section,refused", [
    ({"autotp_size": "auto"}, "'auto' is filled in by the HF Trainer"),
    ({"autotp_size": -1}, "must be an integer >= 0"),
    ({"preset_model": "phi3"}, "not a preset; use one of llama, qwen2"),
    ({"kernel_inject": True}, "DeepSpeed's inference kernel injection is not supported"),
    ({"autotp_size": 2, "tp": {"tp_size": 4}}, "sets tensor_parallel.size=4, but tensor_parallel.autotp_size "
                                               "already set tensor_parallel.size=2"),
    ({"partition_config": {"layer_specs": "o_proj"}}, "must be a list of mappings"),
    ([2], "must be a mapping"),
])
def test_import_deepspeed_tensor_parallel_refusals(tmp_path, section, refused):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"tensor_parallel": section}))
    report = import_config(str(src))
    assert report.refused and f"REFUSED: {refused}" in report.text(), report.text()


def test_import_autotp_size_zero_is_off(tmp_path):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"tensor_parallel": {"autotp_size": 0}}))
    report = import_config(str(src))
    assert report.config == {} and not report.refused
    assert "ignored: 0 disables AutoTP in DeepSpeed" in report.text()


def test_explain_prints_the_plan_of_a_hugging_face_model(tmp_path, capsys):
    """`mixprec config explain --model DIR` prints, per parameter, the split and the local
    shape at tensor_parallel.size (the model built on the meta device), or replicated."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from mixprec.cli import main

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=1).save_pretrained(tmp_path / "m")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tensor_parallel:\n  size: 2\n")
    assert main(["config", "explain", str(cfg), "--model", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj.weight [32, 32]: column dim 0 (hf_plan) -> [16, 32] per rank" in out
    assert "model.layers.0.mlp.down_proj.weight [32, 64]: row dim 1 (hf_plan) -> [32, 32] per rank" in out
    assert "model.layers.0.self_attn.k_proj.weight [8, 32]: whole on every rank (1 key/value head(s) < 2" in out
    assert "model.norm.weight [32]: replicated" in out
    assert main(["config", "explain", str(cfg), "--model", str(tmp_path / "nothing")]) == 1
    assert "not a Hugging Face config.json" in capsys.readouterr().err
