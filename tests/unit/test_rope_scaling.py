"""recipes/models/rope_scaling.py: a scaled folder is the same weights with the config transformers
reads as linear, dynamic NTK or YaRN; bad values and already-scaled models are one line."""

from __future__ import annotations

import json

import pytest
import torch

from recipes.models import __main__ as models_cli
from recipes.models import load_config
from recipes.models.rope_scaling import parse_scaling, scaled_copy

TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


@pytest.fixture
def base(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "source.json").write_text("{}")
    return folder


def rotary_frequencies(folder):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(load_config(str(folder)))
    return rotary.inv_freq, rotary.attention_scaling


def test_each_scaling_is_the_config_transformers_reads_and_the_weights_are_linked(base, tmp_path):
    default_freq, _ = rotary_frequencies(base)
    for kind, positions in (("linear", 2048), ("dynamic", 512), ("yarn", 2048)):
        out = scaled_copy(base, kind, 4.0, tmp_path / kind)
        config = json.loads((out / "config.json").read_text())
        assert config["rope_parameters"]["rope_type"] == kind and config["rope_parameters"]["factor"] == 4.0
        assert config["max_position_embeddings"] == positions  # dynamic rescales from the original length
        assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
        assert not (out / "source.json").exists()  # the download's record is not the scaled model's
        freq, scaling = rotary_frequencies(out)
        if kind == "linear":
            torch.testing.assert_close(freq, default_freq / 4)
        elif kind == "yarn":
            # the highest frequencies kept, the lowest interpolated, attention scaled (0.1 ln 4 + 1)
            assert freq[0] == default_freq[0] and torch.isclose(freq[-1], default_freq[-1] / 4)
            assert abs(scaling - (0.1 * torch.log(torch.tensor(4.0)).item() + 1)) < 1e-6
        else:
            torch.testing.assert_close(freq, default_freq)  # below the original length nothing changes


def test_bad_scalings_are_one_line(base, tmp_path, capsys):
    for bad in ("cubic:2", "yarn", "yarn:1", "yarn:x"):
        with pytest.raises(ValueError, match="use TYPE:FACTOR with TYPE one of linear, dynamic, yarn and FACTOR > 1"):
            parse_scaling(bad)
    assert models_cli.main(["scale", str(base), "--rope", "linear:0.5"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    scaled = scaled_copy(base, "yarn", 4.0, tmp_path / "yarn4")
    assert models_cli.main(["scale", str(scaled), "--rope", "linear:2"]) == 2
    assert "already has rope_type 'yarn'" in capsys.readouterr().err
    assert models_cli.main(["scale", str(base), "--rope", "linear:2"]) == 0
    assert (tmp_path / "base-linear2" / "config.json").is_file()
