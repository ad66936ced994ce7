"""``mixprec config`` (write by flags and by questions), ``explain``, ``reference`` and
``import`` (DeepSpeed JSON, Accelerate YAML)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mixprec.cli import main
from mixprec.config import resolve
from mixprec.config.reference import reference_markdown

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MIXPREC_CONFIG_FILE", "MIXPREC_BACKEND", "MIXPREC_MIXED_PRECISION", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_committed_reference_is_current():
    assert DOCS.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: run `mixprec config reference -o docs/configuration.md`")
    for key in ("zero3.prefetch", "fsdp.reshard_after_forward", "ddp.bucket_cap_mb", "gradient_clipping",
                "max_consecutive_overflows", "MIXPREC_ZERO3_PREFETCH"):
        assert f"`{key}`" in DOCS.read_text()


def test_write_by_flags(tmp_path, capsys):
    out = tmp_path / "mixprec.yaml"
    assert main(["config", "--backend", "zero3", "--mixed-precision", "bf16", "--gradient-clipping", "1.0",
                 "--zero3-units", "TransformerEncoderLayer", "--zero3-prefetch", "false", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == {
        "backend": "zero3", "mixed_precision": "bf16", "gradient_clipping": 1.0,
        "zero3": {"units": ["TransformerEncoderLayer"], "prefetch": False}}
    r = resolve(str(out), env={}, world_size=2)
    assert r.engine_options()["units"] == ("TransformerEncoderLayer",) and r.source("backend") == f"file {out}"
    assert main(["config", "--backend", "ddp", "-o", str(out)]) == 1  # exists
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["config", "--backend", "zero4", "-o", str(tmp_path / "x.yaml")]) == 1
    assert "backend='zero4' is not supported; valid backends: 'auto'" in capsys.readouterr().err


def test_write_by_questions(tmp_path):
    out = tmp_path / "q.yaml"
    answers = "fsdp\nfp8\nbf16\n\n0.5\ny\n" + "\n" * 8 + "false\n" + "\n" * 24  # 8 defaults, then prefetch
    proc = subprocess.run([sys.executable, "-m", "mixprec", "config", "--interactive", "-o", str(out)],
                          input=answers, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "mixed_precision='fp8' is not supported" in proc.stdout  # asked again
    assert yaml.safe_load(out.read_text()) == {
        "backend": "fsdp", "mixed_precision": "bf16", "gradient_clipping": 0.5,
        "fsdp": {"prefetch": False}}


def test_explain_shows_sources_unused_blocks_and_precision(tmp_path, monkeypatch, capsys):
    f = tmp_path / "m.yaml"
    f.write_text("backend: zero2\nmixed_precision: fp16\nzero2:\n  loss_scaler: deepspeed\nddp:\n  bucket_cap_mb: 50\n")
    monkeypatch.setenv("MIXPREC_GRADIENT_ACCUMULATION_STEPS", "4")
    assert main(["config", "explain", str(f)]) == 0
    out = capsys.readouterr().out
    settings = out.split("precision per backend")[0]
    lines = {line.split()[0]: line for line in settings.splitlines() if line.strip()}
    assert lines["backend"].split()[1:] == ["zero2", "file", str(f)]
    assert lines["gradient_accumulation_steps"].split()[1:] == ["4", "env", "MIXPREC_GRADIENT_ACCUMULATION_STEPS"]
    assert lines["gradient_clipping"].split()[1:] == ["null", "default"]
    assert lines["zero2.loss_scaler"].split()[1:3] == ["deepspeed", "file"]
    assert "kept but unused (backend is 'zero2')" in out and lines["ddp.bucket_cap_mb"].split()[1] == "50.0"
    assert "zero3.prefetch" not in lines  # default blocks of other backends are not listed
    rows = {line.split()[0]: line for line in out.split("precision per backend")[1].splitlines()[2:]}
    assert set(rows) == {"single", "ddp", "zero1", "zero2", "zero3", "fsdp"}
    assert "fp16" in rows["ddp"] and "dynamic, torch (init 65536.0, grow every 2000, hysteresis 1)" in rows["ddp"]
    assert "dynamic, deepspeed (init 65536.0, grow every 1000, hysteresis 2)" in rows["zero2"]
    assert "fp32, 1/N shard" in rows["zero3"]


def test_explain_bf16_pure_and_fsdp_conflict(tmp_path, capsys):
    f = tmp_path / "m.yaml"
    f.write_text("mixed_precision: bf16-pure\n")
    assert main(["config", "explain", str(f)]) == 0
    out = capsys.readouterr().out
    assert "zero2    not supported: zero2 keeps fp32 master shards" in out
    assert "none (low-precision weights updated in place)" in out
    f.write_text("mixed_precision: bf16\nfsdp:\n  output_dtype: fp16\n")
    assert main(["config", "explain", str(f)]) == 0
    assert "fsdp     error: engine_options['output_dtype']=torch.float16 conflicts" in capsys.readouterr().out


def test_explain_reports_config_errors(tmp_path, capsys):
    f = tmp_path / "m.yaml"
    f.write_text("zero3:\n  prefech: 1\n")
    assert main(["config", "explain", str(f)]) == 1
    assert "unknown config key 'zero3.prefech'" in capsys.readouterr().err


DEEPSPEED = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8 / 4, "overlap_comm": True,
                          "stage3_prefetch_bucket_size": 0,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}},
}


def test_import_deepspeed(tmp_path, capsys):
    src = tmp_path / "ds_config.json"
    src.write_text(json.dumps(DEEPSPEED))
    out = tmp_path / "mixprec.yaml"
    assert main(["config", "import", str(src), "-o", str(out)]) == 1  # a refused key: nothing written
    err = capsys.readouterr().err
    assert not out.exists() and "nothing written" in err
    assert "zero_optimization.offload_optimizer.device = nvme" in err
    assert "REFUSED: optimizer state offload to nvme is not supported" in err
    for line in ("zero_optimization.stage = 3", "-> backend: zero3", "bf16.enabled = true",
                 "-> mixed_precision: bf16", "-> gradient_clipping: 1.0", "-> gradient_accumulation_steps: 4",
                 "-> zero3.bucket_cap_mb: 476.837158203125", "-> zero3.prefetch: false",
                 "train_batch_size = 64", "ignored: the batch size is your DataLoader's",
                 "ignored: create the optimizer (AdamW) yourself"):
        assert line in err, line
    assert main(["config", "import", str(src), "-o", str(out), "--drop-refused"]) == 0
    assert yaml.safe_load(out.read_text()) == {
        "backend": "zero3", "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "mixed_precision": "bf16",
        "zero3": {"bucket_cap_mb": 476.837158203125, "prefetch": False}}
    cfg = resolve(str(out), env={}, world_size=2).config
    assert (cfg.backend, cfg.mixed_precision, cfg.gradient_clipping, cfg.gradient_accumulation_steps) == \
        ("zero3", "bf16", 1.0, 4)
    assert cfg.zero3.prefetch is False


def test_a_deepspeed_or_accelerate_file_given_as_config_names_the_import_command(tmp_path, capsys, monkeypatch):
    """Issue #36 point 7: Accelerator(config="ds_config.json") with a DeepSpeed JSON (and an
    Accelerate YAML) is recognised, and the error names the command that converts it; the
    command then works as named."""
    from mixprec import Accelerator, ConfigError

    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}))
    acc_yaml = tmp_path / "default_config.yaml"
    acc_yaml.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU",
                                        "mixed_precision": "bf16", "num_processes": 2}))
    for path, kind in ((ds, "is a DeepSpeed config"), (acc_yaml, "is an Accelerate config")):
        with pytest.raises(ConfigError) as e:
            Accelerator(cpu=True, config=str(path))
        message = str(e.value)
        assert kind in message and f"`mixprec config import {path} -o mixprec.yaml`" in message, message
        assert "unknown config key" not in message
        monkeypatch.setenv("MIXPREC_CONFIG_FILE", str(path))  # the environment's file: the same check
        with pytest.raises(ConfigError, match="mixprec config import"):
            resolve(None, world_size=1)
        monkeypatch.delenv("MIXPREC_CONFIG_FILE")
        out = tmp_path / f"{path.stem}-mixprec.yaml"
        assert main(["config", "import", str(path), "-o", str(out)]) == 0  # the named command works
        assert resolve(str(out), env={}, world_size=2).config.mixed_precision == "bf16"
    # A mixprec file with a typo is still the unknown-key error with its suggestion.
    typo = tmp_path / "mine.yaml"
    typo.write_text("backend: zero2\nmixed_precison: bf16\n")
    with pytest.raises(ConfigError, match="unknown config key 'mixed_precison'"):
        resolve(str(typo), env={}, world_size=1)


def test_import_deepspeed_fp16_scaler(tmp_path, capsys):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale": 0},
                               "zero_optimization": {"stage": 2}}))
    out = tmp_path / "m.yaml"
    assert main(["config", "import", str(src), "-o", str(out)]) == 0
    cfg = resolve(str(out), env={}, world_size=2).config
    assert (cfg.backend, cfg.mixed_precision) == ("zero2", "fp16")
    assert (cfg.scaler.init_scale, cfg.scaler.growth_interval, cfg.scaler.hysteresis, cfg.scaler.min_scale) == \
        (4096.0, 1000, 2, 1.0)
    assert "fp16.hysteresis (DeepSpeed default) = 2" in capsys.readouterr().err
    src.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale": 128}}))
    assert main(["config", "import", str(src)]) == 1
    assert "REFUSED: a static loss scale is not supported" in capsys.readouterr().err


def test_import_accelerate_multi_cpu(tmp_path, capsys):
    src = tmp_path / "default_config.yaml"
    src.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: bf16\n"
                   "num_processes: 2\nnum_machines: 1\nmachine_rank: 0\nuse_cpu: true\n")
    assert main(["config", "import", str(src)]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out) == {"backend": "ddp", "mixed_precision": "bf16", "cpu": True}
    assert "distributed_type = MULTI_CPU" in captured.err and "-> backend: ddp" in captured.err
    assert "ignored: --nproc-per-node (per node) of `mixprec launch`" in captured.err


def test_import_accelerate_fsdp(tmp_path, capsys):
    src = tmp_path / "fsdp.yaml"
    src.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\n"
        "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer,LlamaMLP\n"
        "  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_backward_prefetch: NO_PREFETCH\n"
        "  fsdp_offload_params: true\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n")
    out = tmp_path / "m.yaml"
    assert main(["config", "import", str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "fsdp_config.fsdp_offload_params = true" in err and "REFUSED: parameter offload to cpu" in err
    assert main(["config", "import", str(src), "-o", str(out), "--drop-refused"]) == 0
    assert yaml.safe_load(out.read_text()) == {
        "backend": "fsdp", "mixed_precision": "no",
        "fsdp": {"units": ["LlamaDecoderLayer", "LlamaMLP"], "reshard_after_forward": False, "prefetch": False}}


def test_import_unknown_format(tmp_path, capsys):
    src = tmp_path / "x.yaml"
    src.write_text("foo: 1\n")
    assert main(["config", "import", str(src)]) == 1
    assert "neither a DeepSpeed config" in capsys.readouterr().err


def test_launch_passes_the_config_file(tmp_path):
    f = tmp_path / "mixprec.yaml"
    f.write_text("gradient_accumulation_steps: 3\nlog_policy: false\ncpu: true\n")
    script = tmp_path / "train.py"
    out = tmp_path / "out.json"
    script.write_text(
        "import json, sys\nfrom mixprec import Accelerator\nacc = Accelerator()\n"
        f"json.dump([acc.gradient_accumulation_steps, acc.config.source('gradient_accumulation_steps')], open({str(out)!r}, 'w'))\n")
    proc = subprocess.run([sys.executable, "-m", "mixprec", "launch", "--config-file", str(f), str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    steps, source = json.loads(out.read_text())
    assert steps == 3 and source.startswith(f"file {f}") and "MIXPREC_CONFIG_FILE" in source


def test_import_deepspeed_activation_checkpointing(tmp_path, capsys):
    """DeepSpeed's section names no module (the model calls deepspeed.checkpointing.checkpoint):
    it selects nothing, each storage key is ignored or refused with its reason."""
    src = tmp_path / "ds.json"
    section = {"partition_activations": True, "cpu_checkpointing": False,
               "contiguous_memory_optimization": False, "number_checkpoints": 4,
               "synchronize_checkpoint_boundary": False, "profile": True}
    src.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                               "activation_checkpointing": section}))
    out = tmp_path / "m.yaml"
    assert main(["config", "import", str(src), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "activation_checkpointing = (section)" in err
    assert "ignored: DeepSpeed checkpoints only what the model passes to deepspeed.checkpointing.checkpoint" in err
    for key in section:
        assert f"activation_checkpointing.{key} = " in err, key
    assert "model-parallel group of 1" in err and "benchmarks/bench_checkpointing.py" in err
    assert yaml.safe_load(out.read_text()) == {"backend": "zero3", "mixed_precision": "bf16"}
    for key in ("cpu_checkpointing", "contiguous_memory_optimization", "partition"):
        bad = {**section, key: True} if key != "partition" else {"partition": 1}
        src.write_text(json.dumps({"zero_optimization": {"stage": 2}, "activation_checkpointing": bad}))
        assert main(["config", "import", str(src)]) == 1
        err = capsys.readouterr().err
        assert "REFUSED" in err and f"activation_checkpointing.{key} = " in err, err


def test_import_accelerate_fsdp_activation_checkpointing(tmp_path, capsys):
    """Accelerate checkpoints the modules its auto-wrap policy wraps, i.e. mixprec's units."""
    src = tmp_path / "fsdp.yaml"
    src.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_activation_checkpointing: true\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n")
    out = tmp_path / "m.yaml"
    assert main(["config", "import", str(src), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "fsdp_config.fsdp_activation_checkpointing = true" in err
    assert "-> activation_checkpointing.units: true (every sharding unit)" in err
    assert yaml.safe_load(out.read_text()) == {
        "backend": "fsdp", "fsdp": {"units": ["LlamaDecoderLayer"]}, "activation_checkpointing": {"units": True}}
    cfg = resolve(str(out), env={}, world_size=2).config
    assert cfg.activation_checkpointing.units is True and cfg.fsdp.units == ("LlamaDecoderLayer",)
    src.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_activation_checkpointing: false\n")
    assert main(["config", "import", str(src)]) == 0
    assert "fsdp_config.fsdp_activation_checkpointing = false" in capsys.readouterr().err
