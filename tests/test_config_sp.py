"""The ``sequence_parallel`` config block: defaults, every source, the world-size check,
the TP x SP refusal, ``prepare_sp_inputs`` in one process, and the import of DeepSpeed's
AutoSP (``compile.passes: ["autosp"]`` + ``sequence_parallel_size``). Single process, no
distributed run (the multi-process runs: tests/distributed/test_sequence_parallel.py)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from mixprec import Accelerator
from mixprec.cli import main
from mixprec.config import ConfigError, MixprecConfig, SequenceParallelOptions, config_to_dict, resolve
from mixprec.config.importers import import_config
from mixprec.parallel.mesh import MeshError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MIXPREC_CONFIG_FILE", "WORLD_SIZE", "MIXPREC_SEQUENCE_PARALLEL_SIZE",
                 "MIXPREC_TENSOR_PARALLEL_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _resolve(config=None, env=None, world_size=1):
    return resolve(config, env=env or {}, world_size=world_size)


def test_defaults_and_sources(tmp_path):
    r = _resolve()
    assert r.config.sequence_parallel == SequenceParallelOptions(size=1, prepare_batches=False, seq_dim=1)
    assert "sequence_parallel" not in config_to_dict(r.config)
    r = _resolve({"sequence_parallel": {"size": 2, "prepare_batches": True}}, world_size=4)
    assert r.config.sequence_parallel.size == 2 and r.source("sequence_parallel.size") == "config dict"
    f = tmp_path / "m.yaml"
    f.write_text("sequence_parallel:\n  size: 4\n  seq_dim: 0\n")
    r = _resolve(str(f), world_size=8)
    assert (r.config.sequence_parallel.size, r.config.sequence_parallel.seq_dim) == (4, 0)
    r = _resolve(MixprecConfig(sequence_parallel=SequenceParallelOptions(size=2)))
    assert r.source("sequence_parallel.size") == "config object"
    r = _resolve(env={"MIXPREC_SEQUENCE_PARALLEL_SIZE": "2"}, world_size=2)
    assert r.config.sequence_parallel.size == 2 and r.source("sequence_parallel.size") == \
        "env MIXPREC_SEQUENCE_PARALLEL_SIZE"
    with pytest.raises(ConfigError, match=r"'sequence_parallel.size' is given twice with different values: 4 by "
                                          r"config dict and 2 by env MIXPREC_SEQUENCE_PARALLEL_SIZE"):
        _resolve({"sequence_parallel": {"size": 4}}, env={"MIXPREC_SEQUENCE_PARALLEL_SIZE": "2"})
    with pytest.raises(ConfigError, match=r"sequence_parallel.size=0 must be an int >= 1"):
        _resolve({"sequence_parallel": {"size": 0}})
    out = tmp_path / "w.yaml"
    assert main(["config", "--sequence-parallel-size", "2", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == {"sequence_parallel": {"size": 2}}


def test_world_size_and_layout_errors_name_the_numbers():
    assert _resolve({"sequence_parallel": {"size": 2}}, world_size=4).config.sequence_parallel.size == 2
    with pytest.raises(ConfigError, match=r"sequence_parallel.size=4 \(from config dict\) does not divide the world "
                                          r"size 6: sequence-parallel groups are 4 consecutive ranks"):
        _resolve({"sequence_parallel": {"size": 4}}, world_size=6)
    with pytest.raises(MeshError, match=r"sequence_parallel.size=2 does not divide the world size 1"):
        Accelerator(config={"sequence_parallel": {"size": 2}}, cpu=True, log_policy=False)
    # TP x SP: one mesh; their product must divide the world
    with pytest.raises(MeshError, match=r"tensor_parallel.size=2 x sequence_parallel.size=2 \(= 4 ranks per model "
                                        r"copy\) does not divide the world size 1"):
        Accelerator(config={"sequence_parallel": {"size": 2}, "tensor_parallel": {"size": 2}}, cpu=True,
                    log_policy=False)


def test_prepare_sp_inputs_in_one_process_is_the_whole_sequence():
    """Without SP the same keys, whole: HF's loss from them equals its own on ``labels``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    acc = Accelerator(cpu=True, log_policy=False)
    torch.manual_seed(0)
    model = acc.prepare(LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                     num_hidden_layers=1, num_attention_heads=2,
                                                     num_key_value_heads=1, attn_implementation="sdpa")))
    ids = torch.randint(0, 32, (2, 12))
    labels = ids.clone()
    labels[:, :3] = -100
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    batch = acc.prepare_sp_inputs(input_ids=ids, labels=labels, attention_mask=mask)
    assert sorted(batch) == ["attention_mask", "input_ids", "labels", "num_items_in_batch", "position_ids",
                             "shift_labels"]
    assert torch.equal(batch["shift_labels"][:, :-1], labels[:, 1:]) and (batch["shift_labels"][:, -1] == -100).all()
    assert float(batch["num_items_in_batch"]) == int((labels[:, 1:] != -100).sum())
    assert torch.equal(batch["position_ids"], torch.arange(12).expand(2, 12))
    ref = model(input_ids=ids, labels=labels, attention_mask=mask).loss
    assert torch.allclose(model(**batch).loss, ref, rtol=1e-6, atol=0)
    own = acc.sp_loss(model(input_ids=ids, attention_mask=mask).logits, batch)
    assert torch.allclose(own, ref, rtol=1e-6, atol=0)
    alias = acc.prepare_autosp_inputs(ids, labels, None, mask, 1)
    assert all(torch.equal(alias[k], v) for k, v in batch.items())
    with pytest.raises(ValueError, match=r"seq_dim=2 is not a dimension of input_ids of shape \(2, 12\)"):
        acc.prepare_sp_inputs(input_ids=ids, labels=labels, seq_dim=2)
    with pytest.raises(ValueError, match=r"labels of shape \(2, 11\) does not match input_ids of shape \(2, 12\)"):
        acc.prepare_sp_inputs(input_ids=ids, labels=labels[:, 1:])
    with pytest.raises(ValueError, match=r"the batch has no shift_labels"):
        acc.sp_loss(torch.zeros(2, 12, 32), {"input_ids": ids})


def test_prepare_batches_needs_mappings():
    acc = Accelerator(cpu=True, log_policy=False, config={"sequence_parallel": {"prepare_batches": True}})
    ids = torch.arange(24).view(3, 8)
    loader = acc.prepare(torch.utils.data.DataLoader([{"input_ids": r, "labels": r, "doc": i}
                                                      for i, r in enumerate(ids)], batch_size=3))
    batch = next(iter(loader))
    assert torch.equal(batch["input_ids"], ids) and batch["doc"].tolist() == [0, 1, 2]
    assert torch.equal(batch["shift_labels"][:, :-1], ids[:, 1:]) and float(batch["num_items_in_batch"]) == 21
    tensors = acc.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=3))
    with pytest.raises(TypeError, match=r"sequence_parallel.prepare_batches needs batches that are mappings with "
                                        r"'input_ids' .* got list"):
        next(iter(tensors))


def test_import_deepspeed_autosp(tmp_path, capsys):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
                               "compile": {"deepcompile": True, "passes": ["autosp"]},
                               "sequence_parallel_size": 4}))
    out = tmp_path / "m.yaml"
    assert main(["config", "import", str(src), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "sequence_parallel_size = 4" in err and "-> sequence_parallel.size: 4" in err, err
    assert "compile.deepcompile = true" in err and "ignored: a DeepCompile option" in err, err
    assert yaml.safe_load(out.read_text()) == {"backend": "ddp", "mixed_precision": "bf16",
                                               "sequence_parallel": {"size": 4}}
    assert resolve(str(out), env={}, world_size=8).config.sequence_parallel.size == 4
    # AutoSP without a size is off (size 1); a size without the pass still sets the block
    # (DeepSpeed's Ulysses DistributedAttention reads it too); an unknown pass is refused.
    src.write_text(json.dumps({"compile": {"passes": ["autosp", "z3"]}}))
    report = import_config(str(src))
    assert report.config == {} and "sequence_parallel_size is not given" in report.text()
    assert "the backend comes from zero_optimization.stage" in report.text()
    src.write_text(json.dumps({"bf16": {"enabled": True}, "sequence_parallel_size": 2}))
    assert import_config(str(src)).config["sequence_parallel"] == {"size": 2}
    src.write_text(json.dumps({"compile": {"passes": ["autosp", "mystery"]}, "sequence_parallel_size": 0}))
    report = import_config(str(src))
    assert report.refused == ["sequence_parallel_size", "compile.passes"], report.text()


def test_selective_checkpointing_needs_checkpointed_modules():
    acc = Accelerator(cpu=True, log_policy=False, activation_checkpointing={"selective": True})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"activation_checkpointing.selective=true keeps the attention outputs of "
                                          r"the checkpointed modules, but none is chosen; name them"):
        acc.prepare(model)
    assert not any(hasattr(type(m), "_mixprec_ckpt_original") for m in model.modules())  # refused before any change
