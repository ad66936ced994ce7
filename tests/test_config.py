"""The config schema and its sources: every error path, one source per value, and
Accelerator(config=...) training bitwise like the keyword arguments."""

from __future__ import annotations

import json

import pytest
import torch

from _helpers import loss_fn, make_mlp, mlp_batches
from mixprec import Accelerator
from mixprec.config import ConfigError, MixprecConfig, Zero3Options, resolve
from mixprec.config.fields import block_fields
from mixprec.config.schema import BACKEND_BLOCKS
from mixprec.engines import ENGINES


def _resolve(config=None, env=None, **kw):
    return resolve(config, env=env or {}, world_size=kw.pop("world_size", 1), **kw)


def test_defaults_and_sources():
    r = _resolve({"backend": "zero3", "zero3": {"prefetch": False}}, env={"MIXPREC_MIXED_PRECISION": "bf16"},
                 args={"gradient_clipping": (1.0, "gradient_clipping")}, world_size=2)
    assert r.config.backend == "zero3" and r.backend == "zero3"
    assert r.config.mixed_precision == "bf16" and r.source("mixed_precision") == "env MIXPREC_MIXED_PRECISION"
    assert r.settings["gradient_clipping"].kind == "arg" and r.config.gradient_clipping == 1.0
    assert r.settings["zero3.prefetch"].kind == "object" or r.source("zero3.prefetch") == "config dict"
    assert r.source("gradient_accumulation_steps") == "default"
    assert r.engine_options() == {**{k: v for k, v in r.engine_options().items()}, "prefetch": False}
    assert "units" not in r.engine_options()  # null: the engine's default


def test_unknown_key_suggests_and_lists():
    with pytest.raises(ConfigError, match=r"unknown config key 'mixed_precison' \(from config dict\)\. "
                                          r"Did you mean 'mixed_precision'\? Valid keys at the top level: backend, "):
        _resolve({"mixed_precison": "bf16"})


def test_nested_unknown_key_names_its_path(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("backend: zero3\nzero3:\n  prefech: true\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'zero3.prefech' \(from file {f}\)\. Did you mean "
                                          r"'prefetch'\? Valid keys in block 'zero3': bucket_cap_mb, .*reshard_after_forward"):
        _resolve(str(f))


@pytest.mark.parametrize("key,value,message", [
    ("gradient_accumulation_steps", "4", r"gradient_accumulation_steps='4' must be an int >= 1 \(from config dict\)"),
    ("gradient_accumulation_steps", 0, r"gradient_accumulation_steps=0 must be an int >= 1"),
    ("gradient_clipping", -1.0, r"gradient_clipping=-1.0 must be null or a number > 0"),
    ("cpu", "yes", r"cpu='yes' must be true or false"),
    ("param_dtype", "int8", r"param_dtype='int8' is not supported; use one of 'fp32', 'bf16', 'fp16'"),
    ("zero3", 3, r"config key 'zero3' \(from config dict\) must be a block of keys \(bucket_cap_mb, "),
])
def test_wrong_type_names_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        _resolve({key: value})


def test_nested_wrong_type():
    with pytest.raises(ConfigError, match=r"ddp.bucket_cap_mb='big' must be a number > 0 \(MiB\)"):
        _resolve({"ddp": {"bucket_cap_mb": "big"}})


def test_bad_backend_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"backend='zero4' is not supported; valid backends: 'auto', 'single', "
                                          r"'ddp', 'zero1', 'zero2', 'zero3', 'fsdp' \(from config dict\)\. "
                                          r"Did you mean 'zero3'\?"):
        _resolve({"backend": "zero4"})


def test_file_vs_argument_conflict_names_both(tmp_path):
    f = tmp_path / "mixprec.yaml"
    f.write_text("mixed_precision: bf16\n")
    with pytest.raises(ConfigError, match=rf"config key 'mixed_precision' is given twice with different values: "
                                          rf"bf16 by file {f} and fp16 by argument mixed_precision="):
        Accelerator(config=str(f), mixed_precision="fp16", cpu=True)
    # The same value from both is no conflict.
    assert Accelerator(config=str(f), mixed_precision="bf16", cpu=True, log_policy=False).mixed_precision == "bf16"


def test_env_vs_argument_conflict_names_both(monkeypatch):
    monkeypatch.setenv("MIXPREC_GRADIENT_ACCUMULATION_STEPS", "4")
    with pytest.raises(ConfigError, match=r"'gradient_accumulation_steps' is given twice with different values: "
                                          r"4 by env MIXPREC_GRADIENT_ACCUMULATION_STEPS and 2 by argument "
                                          r"gradient_accumulation_steps="):
        Accelerator(gradient_accumulation_steps=2, cpu=True)
    assert Accelerator(cpu=True, log_policy=False).gradient_accumulation_steps == 4


def test_env_vs_file_conflict(tmp_path, monkeypatch):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"backend": "single"}))
    monkeypatch.setenv("MIXPREC_BACKEND", "ddp")
    with pytest.raises(ConfigError, match=rf"single by file {f} and ddp by env MIXPREC_BACKEND"):
        Accelerator(config=str(f), cpu=True)


def test_env_typo_is_an_error_other_mixprec_vars_are_not():
    with pytest.raises(ConfigError, match=r"MIXPREC_MIXED_PRECISON='bf16' is not a mixprec config variable\. "
                                          r"Did you mean MIXPREC_MIXED_PRECISION\?"):
        _resolve(env={"MIXPREC_MIXED_PRECISON": "bf16"})
    assert _resolve(env={"MIXPREC_CPU_CAPABILITY": "avx2"}).config == MixprecConfig()


def test_env_text_parsing():
    r = _resolve(env={"MIXPREC_KEEP_FP32_MODULES": "LayerNorm, head", "MIXPREC_DATA_SEED": "null",
                      "MIXPREC_ZERO3_PREFETCH": "false", "MIXPREC_SCALER_MAX_SCALE": "65536",
                      "MIXPREC_MAX_CONSECUTIVE_OVERFLOWS": "none"})
    c = r.config
    assert c.keep_fp32_modules == ("LayerNorm", "head") and c.data_seed is None
    assert c.zero3.prefetch is False and c.scaler.max_scale == 65536.0 and c.max_consecutive_overflows is None
    with pytest.raises(ConfigError, match=r"zero3.prefetch='maybe' must be true or false \(from env MIXPREC_ZERO3_PREFETCH\)"):
        _resolve(env={"MIXPREC_ZERO3_PREFETCH": "maybe"})


def test_config_file_env_from_launch(tmp_path, monkeypatch):
    f = tmp_path / "mixprec.yaml"
    f.write_text("gradient_accumulation_steps: 3\ngradient_clipping: 0.5\n")
    monkeypatch.setenv("MIXPREC_CONFIG_FILE", str(f))
    acc = Accelerator(cpu=True, log_policy=False)
    assert acc.gradient_accumulation_steps == 3 and acc.gradient_clipping == 0.5
    assert acc.config.source("gradient_clipping").startswith(f"file {f}")
    # The same file passed again is one source; a conflicting argument is not.
    assert Accelerator(config=str(f), cpu=True, log_policy=False).gradient_accumulation_steps == 3
    with pytest.raises(ConfigError, match=r"3 by file .*MIXPREC_CONFIG_FILE.* and 5 by argument"):
        Accelerator(gradient_accumulation_steps=5, cpu=True)


def test_engine_options_map_to_the_selected_block():
    r = _resolve({"backend": "zero3", "ddp": {"bucket_cap_mb": 50}}, world_size=2,
                 engine_options={"prefetch": False, "units": [torch.nn.Linear]})
    assert r.engine_options()["prefetch"] is False and r.config.zero3.units == ("Linear",)
    assert r.config.ddp.bucket_cap_mb == 50.0 and "bucket_cap_mb" in r.engine_options()
    assert r.engine_options()["bucket_cap_mb"] == 25.0  # ddp's block is kept but not used
    with pytest.raises(ConfigError, match=r"unknown engine option 'prefech' for backend 'zero3' \(config key "
                                          r"'zero3.prefech'\)\. Did you mean 'prefetch'\?"):
        _resolve({"backend": "zero3"}, world_size=2, engine_options={"prefech": False})
    with pytest.raises(ConfigError, match=r"'zero3.prefetch' is given twice with different values: true by "
                                          r"config dict and false by argument engine_options\['prefetch'\]"):
        _resolve({"backend": "zero3", "zero3": {"prefetch": True}}, world_size=2, engine_options={"prefetch": False})
    with pytest.raises(ConfigError, match=r"backend='auto' runs 'single', which takes no options"):
        Accelerator(cpu=True, engine_options={"bucket_cap_mb": 5})


def test_config_object_gives_only_changed_fields():
    cfg = MixprecConfig(mixed_precision="bf16", zero3=Zero3Options(prefetch=False))
    r = _resolve(cfg, args={"backend": ("single", "backend")})
    assert r.source("mixed_precision") == "config object" and r.source("backend") == "argument backend="
    assert r.source("zero3.prefetch") == "config object" and r.source("cpu") == "default"


def test_schema_defaults_match_engine_defaults():
    import inspect

    for backend, block in BACKEND_BLOCKS.items():
        params = {}
        for cls in ENGINES[backend].__mro__:
            if "__init__" in vars(cls):
                params.update({k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                               if k not in params and p.default is not inspect.Parameter.empty})
        for name, (_tp, default, _f) in block_fields(block).items():
            assert name in params, f"{backend}: schema option {name!r} is not an engine argument"
            if default is not None:
                assert params[name] == default, f"{backend}.{name}: schema {default!r} != engine {params[name]!r}"


def test_two_accelerators_with_different_settings_in_one_process():
    a = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2, cpu=True, log_policy=False)
    b = Accelerator(config={"mixed_precision": "no", "gradient_clipping": 1.0}, cpu=True, log_policy=False)
    assert (a.mixed_precision, a.gradient_accumulation_steps, a.gradient_clipping) == ("bf16", 2, None)
    assert (b.mixed_precision, b.gradient_accumulation_steps, b.gradient_clipping) == ("no", 1, 1.0)
    models = [make_mlp(0), make_mlp(0)]
    for acc, model in zip((a, b), models):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        for x, y in mlp_batches(2):
            with acc.accumulate(model):
                acc.backward(loss_fn(model(x), y))
                opt.step()
                opt.zero_grad()
    assert a.last_step.stepped and b.last_step.stepped
    assert b.last_step.grad_norm is not None and a.last_step.grad_norm is None  # b auto-clipped, a did not
    assert a.mixed_precision == "bf16" and b.mixed_precision == "no"


def test_max_consecutive_overflows_keyword_and_key():
    assert Accelerator(cpu=True, log_policy=False).max_consecutive_overflows == 20
    assert Accelerator(cpu=True, log_policy=False, max_consecutive_overflows=None).max_consecutive_overflows is None
    assert Accelerator(cpu=True, log_policy=False, config={"max_consecutive_overflows": 5}).max_consecutive_overflows == 5
    with pytest.raises(ConfigError, match=r"max_consecutive_overflows=0 must be null or an int >= 1"):
        Accelerator(cpu=True, max_consecutive_overflows=0)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_config_file_trains_bitwise_like_keyword_arguments(tmp_path, mixed_precision):
    f = tmp_path / "mixprec.yaml"
    f.write_text(f"backend: single\nmixed_precision: {mixed_precision}\ngradient_accumulation_steps: 2\n"
                 "cpu: true\nlog_policy: false\nscaler:\n  init_scale: 1024\n  growth_interval: 3\n")
    from mixprec import ScalerConfig

    runs = []
    for kwargs in ({"config": str(f)},
                   {"backend": "single", "mixed_precision": mixed_precision, "gradient_accumulation_steps": 2,
                    "cpu": True, "log_policy": False, "scaler": ScalerConfig(init_scale=1024, growth_interval=3)}):
        acc = Accelerator(**kwargs)
        model = make_mlp(3)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for x, y in mlp_batches(8):
            with acc.accumulate(model):
                loss = loss_fn(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in acc.get_state_dict(model).values()], acc.loss_scale))
    (l1, p1, s1), (l2, p2, s2) = runs
    assert l1 == l2 and s1 == s2
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    if mixed_precision == "fp16":
        assert s1 is not None and s1 != 2.0**16  # the file's scaler settings were applied
