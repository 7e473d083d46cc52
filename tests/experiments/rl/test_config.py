"""The RL config's validation."""
from __future__ import annotations

import pytest

from experiments.rl.config import RLConfig
from system.errors import ConfigError


def test_rl_config_errors_name_the_field():
    # a section names its own fields; the override machinery adds where it is mounted
    with pytest.raises(ConfigError, match="^mode='fast'"):
        RLConfig(mode="fast")
    with pytest.raises(ConfigError, match="sync_interval"):
        RLConfig(sync_interval=3, max_head_offpolicyness=1)
    with pytest.raises(ConfigError, match="sync mode"):
        RLConfig(mode="sync", sync_interval=2)
    with pytest.raises(ConfigError, match="group_size"):
        RLConfig(group_size=1)
    assert RLConfig(mode="sync", max_head_offpolicyness=3).eta == 0


def test_a_model_directory_without_a_tokenizer_is_refused(tmp_path):
    import os

    from experiments.rl.config import resolve_model_path

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^rl.model_path='.*' has no tokenizer \(none of "
                                          r"tokenizer.json, .*copy the base model's"):
        resolve_model_path(RLConfig(model_path=str(tmp_path)), "arith-tiny")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert resolve_model_path(RLConfig(model_path=str(tmp_path)), "arith-tiny") == \
        os.path.abspath(tmp_path)


@pytest.mark.parametrize("model", ["arith-tiny", "smollm2-135m-instruct"])
def test_a_saved_tokenizer_loads_and_encodes_as_the_base_models(model, tmp_path):
    import os

    from experiments.rl.common import encode_prompt, load_tokenizer, save_tokenizer
    from system.paths import PROJECT_ROOT

    base = os.path.join(PROJECT_ROOT, ".models", model)
    if not os.path.isfile(os.path.join(base, "config.json")):
        pytest.skip("the models are created by scripts/setup.sh")
    tok = load_tokenizer(base)
    save_tokenizer(tok, str(tmp_path))  # what a checkpoint's actor/ gets beside the weights
    again = load_tokenizer(str(tmp_path))
    for chat in (False, True):
        assert encode_prompt(again, "12+30=", chat) == encode_prompt(tok, "12+30=", chat) != []
    assert again.eos_token_id == tok.eos_token_id
