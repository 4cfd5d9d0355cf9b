import argparse

import pytest

from flux_jax import config_cli
from flux_jax.errors import UserError


def _parser():
    p = argparse.ArgumentParser(prog="test")
    config_cli.add_config_argument(p)
    p.add_argument("--workdir", required=True)
    return p


def _parse(*overrides, config="configs/toy.py"):
    return config_cli.parse(_parser(), ["--config", config, "--workdir", "w", *overrides])


def test_overrides_take_each_fields_type():
    args, c = _parse(
        "--config.lr=2e-3",
        "--config.train_iters",
        "7",
        "--config.fp8_wgrad=false",
        "--config.fp8=None",
        "--config.target_val_loss=0.25",
        "--config.model.depth=3",
        "--config.data.source=mock",
        "--config.checkpoint.async_save=0",
    )
    assert args.workdir == "w" and c.lr == 2e-3 and c.train_iters == 7 and c.fp8_wgrad is False
    assert c.fp8 is None and c.target_val_loss == 0.25 and c.model.depth == 3
    assert c.data.source == "mock" and c.checkpoint.async_save is False
    _, c = _parse("--config.lr=1")  # an integer for a float field stays a float
    assert c.lr == 1.0 and isinstance(c.lr, float)
    _, c = _parse(config="configs/toy.py:fp8")
    assert c.fp8 == "e4m3"


def test_every_bad_override_in_one_error_with_suggestions():
    with pytest.raises(UserError) as err:
        _parse(
            "--config.learning_rate=1e-3",
            "--config.model.presett=tiny",
            "--config.lr=fast",
            "--config.data.image_size=1.5",
            "--config.fp8_wgrad=maybe",
            "--config.model=tiny",
        )
    message = str(err.value)
    assert message.startswith("Invalid command line (6 problems):")
    assert "--config.learning_rate: unknown field. Did you mean --config.lr?" in message
    assert "--config.model.presett: unknown field. Did you mean --config.model.preset?" in message
    assert "--config.lr='fast': expected a number" in message
    assert "--config.data.image_size='1.5': expected an integer" in message
    assert "--config.fp8_wgrad='maybe': expected true or false" in message
    assert "--config.model is a group of fields" in message


@pytest.mark.parametrize(
    "typo,expected",
    [
        ("learning_rate", "lr"),
        ("max_steps", "train_iters"),
        ("batch_size", "global_batch_size"),
        ("warmup_steps", "lr_warmup_iters"),
        ("fp8_recipie", "fp8_recipe"),
        ("data.imagesize", "data.image_size"),
        ("eval_every", "eval_interval"),
    ],
)
def test_suggestions(typo, expected):
    from configs import toy

    assert expected in config_cli.suggestions(typo, list(config_cli.fields(toy.get_config())))


def test_missing_config_file_and_bad_config_argument():
    with pytest.raises(UserError, match=r"--config configs/nope\.py: no such config file .*configs/toy\.py"):
        _parse(config="configs/nope.py")
    with pytest.raises(UserError, match=r"--config configs/toy\.py:fp16: .*unknown argument 'fp16'"):
        _parse(config="configs/toy.py:fp16")
    with pytest.raises(UserError, match=r"--config\.lr has no value"):
        _parse("--config.lr")
    with pytest.raises(UserError, match=r"--config\.fp8_wgrad has no value"):
        config_cli.parse(_parser(), ["--config", "configs/toy.py", "--config.fp8_wgrad", "--workdir", "w"])


def test_help_lists_the_fields_with_their_comments(capsys):
    with pytest.raises(SystemExit) as exit_:
        config_cli.parse(_parser(), ["--config", "configs/toy.py", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--config.FIELD=VALUE" in out
    assert "--config.lr=0.001" in out and "peak learning rate" in out
    assert "--config.data.image_size=128" in out


def test_config_file_with_a_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def get_config(arg=None):\n    return (\n")
    with pytest.raises(UserError, match=r"--config .*mine\.py: .*mine\.py line \d+: .*fix the config file"):
        config_cli.load_config(str(path))
