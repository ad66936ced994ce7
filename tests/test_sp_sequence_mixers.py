"""sequence parallelism refuses, at prepare(), models that mix the sequence outside SDPA
([Note: sequence mixing outside SDPA] in src/mixprec/parallel/sequence/ulysses.py). The
checks are single-process (``check_model`` is what ``Accelerator.prepare`` calls under SP);
tests/distributed/test_model_matrix.py runs them on every transformers model type."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from mixprec.parallel.sequence import UnsupportedAttentionError
from mixprec.parallel.sequence.ulysses import _mixer_name, check_model


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x).unflatten(-1, (2, 4)).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)


class _Block(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer
        self.mlp = nn.Linear(8, 8)


class _Model(nn.Module):
    def __init__(self, *mixers: nn.Module, layer_types=None):
        super().__init__()
        self.layers = nn.ModuleList(_Block(m) for m in mixers)
        if layer_types is not None:
            self.config = types.SimpleNamespace(_attn_implementation="sdpa", layer_types=layer_types)


class ShortConvMixer(nn.Module):  # a depthwise causal convolution over the sequence, as in lfm/mamba
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, kernel_size=4, groups=8, padding=3)


class _DynamicMaskAttention(_Attention):
    def prepare_dynamic_mask(self, x):  # builds a float mask from the local slice, as doge does
        return x


def _refusal(model) -> str:
    with pytest.raises(UnsupportedAttentionError) as e:
        check_model(model)
    return str(e.value)


def test_plain_sdpa_model_passes():
    check_model(_Model(_Attention(), _Attention(), layer_types=["full_attention", "sliding_attention"]))
    check_model(_Model(_Attention(), layer_types=["full_attention"]))
    # a per-token convolution (kernel 1) does not mix the sequence
    check_model(_Model(_Attention(), nn.Conv1d(8, 8, kernel_size=1)))


def test_convolution_over_the_sequence_is_refused_naming_the_module():
    msg = _refusal(_Model(_Attention(), _Model(nn.Conv1d(8, 8, kernel_size=3))))
    assert "'layers.1.mixer.layers.0.mixer' (Conv1d)" in msg and "kernel 3" in msg
    assert "sequence_parallel.size: 1" in msg


def test_named_sequence_mixer_is_refused_innermost_first():
    msg = _refusal(_Model(_Attention(), ShortConvMixer()))
    # the mixer, not its convolution
    assert "module 'layers.1.mixer' (ShortConvMixer)" in msg and "(and " not in msg
    assert "sequence_parallel.size: 1" in msg


def test_attention_with_its_own_mask_method_is_refused():
    msg = _refusal(_Model(_DynamicMaskAttention()))
    assert "'layers.0.mixer' (_DynamicMaskAttention)" in msg and "prepare_dynamic_mask" in msg


def test_config_layer_kinds_are_refused_naming_the_layer():
    msg = _refusal(_Model(_Attention(), _Attention(), layer_types=["full_attention", "linear_attention"]))
    assert "config.layer_types[1] = 'linear_attention'" in msg and "module layers.1" in msg
    # MLP kinds are not sequence mixers
    check_model(_Model(_Attention(), _Attention(), layer_types=["moe", "dense"]))
    m = _Model(_Attention(), _Attention())
    m.config = types.SimpleNamespace(_attn_implementation="sdpa", hybrid_override_pattern="*M")
    assert "hybrid_override_pattern[1] = 'M'" in _refusal(m)


@pytest.mark.parametrize("name, mixer", [
    ("SeedOssModel", False), ("LlamaAttention", False), ("MixtralSparseMoeBlock", False), ("GPT2Attention", False),
    ("Qwen3NextGatedDeltaNet", True), ("FalconH1Mixer", True), ("MiniMaxLightningAttention", True),
    ("Lfm3ShortConv", True), ("MambaSSM", True), ("KimiLinearDeltaAttention", True),
])
def test_class_name_words(name, mixer):
    assert _mixer_name(name) is mixer


# [Note: windowed attention under SP]: a sequence longer than the smallest window raises at
# that forward (the window would be lost over the slices); within it, Ulysses runs.
class _WindowAttention(_Attention):
    def __init__(self, window):
        super().__init__()
        self.sliding_window = window


def test_window_limit_is_the_smallest_window_named():
    from mixprec.parallel.sequence.ulysses import _window_limit

    assert _window_limit(_Model(_Attention(), _WindowAttention(None))) is None
    size, what = _window_limit(_Model(_WindowAttention(None), _WindowAttention(64), _WindowAttention(16)))
    assert size == 16 and "'layers.2.mixer' (_WindowAttention)" in what
    mistral_like = _Model(_Attention())  # the config's window on every layer (Mistral, Phi3)
    mistral_like.layers[0].mixer.config = types.SimpleNamespace(sliding_window=32)
    assert _window_limit(mistral_like)[0] == 32
    mistral_like.layers[0].mixer.config.use_sliding_window = False  # Qwen2-style switch off
    assert _window_limit(mistral_like) is None


def test_sequence_longer_than_the_window_raises_under_sp():
    from mixprec.parallel.sequence.ulysses import _UlyssesMode

    class _Stub:
        size = 2

        def attention(self, *args, **kwargs):
            return "ran"

    q = torch.zeros(1, 2, 5, 4)  # this rank's slice of 5 tokens: 10 over the SP group
    with _UlyssesMode(_Stub(), None, (8, "sliding window of 8 tokens of module 'x' (A)")):
        with pytest.raises(UnsupportedAttentionError, match="10 tokens, more than the sliding window of 8"):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with _UlyssesMode(_Stub(), None, (10, "w")):
        assert torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True) == "ran"
