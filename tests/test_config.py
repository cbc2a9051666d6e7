"""ModelConfig.from_hf: Jet-Nemotron configs as the official code reads them, Qwen2/Llama as all-attention."""

import json

import pytest

from jetserve.checkpoint import PRESETS
from jetserve.config import ConfigError, ModelConfig


def _write(tmp_path, data):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def test_2b_preset_derived_sizes(tmp_path):
    config = ModelConfig.from_hf(_write(tmp_path, PRESETS["2b"]))
    jet = config.jet
    assert (jet.head_v_dim, jet.key_dim, jet.value_dim, jet.generator_dim) == (256, 1152, 3072, 384)
    assert config.attention_layer_ids == (14, 19, 20, 21)
    assert len(config.jet_layer_ids) == 24
    assert config.swa_window_size == 1152
    assert jet.norm_eps == 1e-5 and jet.conv_size == 4


def test_4b_preset_derived_sizes():
    config = ModelConfig.from_dict(PRESETS["4b"])
    assert (config.jet.head_v_dim, config.jet.value_dim, config.jet.generator_dim) == (256, 4096, 512)
    assert [i for i, k in enumerate(config.layer_types) if k == "attn"] == [17, 20, 32]
    assert config.swa_window_size == 2048


def test_layer_types_as_string_and_norm_eps_as_string():
    data = json.loads(json.dumps(PRESETS["tiny"]))
    data["layer_types"] = str(data["layer_types"])  # "['jet', 'swa', 'jet', 'attn']"
    data["efficient_attention_config"]["jet"]["norm_eps"] = "1e-6"
    config = ModelConfig.from_dict(data)
    assert config.layer_types == ("jet", "swa", "jet", "attn")
    assert config.jet.norm_eps == 1e-6


def test_qwen2_and_llama_are_all_attention():
    qwen = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "tie_word_embeddings": False,
    }
    config = ModelConfig.from_dict(qwen)
    assert config.layer_types == ("attn",) * 3 and config.attention_bias and config.head_dim == 16
    llama = dict(qwen, model_type="llama")
    assert not ModelConfig.from_dict(llama).attention_bias
    assert ModelConfig.from_dict(dict(llama, attention_bias=True)).attention_bias


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"model_type": "mamba"}, "model_type"),
        ({"layer_types": ["jet", "swa"]}, "layer_types"),
        ({"layer_types": ["jet", "swa", "jet", "conv"]}, "layer_types"),
        ({"layer_types": "not a list ["}, "layer_types"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": "wide"}, "hidden_size"),
        ({"efficient_attention_config": {"jet": PRESETS["tiny"]["efficient_attention_config"]["jet"]}}, "window_size"),
        ({"efficient_attention_config": {"swa": {"window_size": 16}}}, "efficient_attention_config.jet"),
    ],
)
def test_bad_config_names_the_field(edit, field):
    data = json.loads(json.dumps(PRESETS["tiny"])) | edit
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict(data)


def test_bad_jet_section_names_the_field():
    data = json.loads(json.dumps(PRESETS["tiny"]))
    data["efficient_attention_config"]["jet"]["dconv_generator_reduction"] = 7
    with pytest.raises(ConfigError, match="dconv_generator_reduction"):
        ModelConfig.from_dict(data)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
