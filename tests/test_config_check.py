import pytest

from configs import toy as toy_config
from flux_jax import config_check


def test_toy_config_is_valid_on_its_devices():
    config_check.validate(toy_config.get_config(), num_devices=1)


def test_every_invalid_field_is_named_in_one_error():
    c = toy_config.get_config()
    c.model.attention = "flash"
    c.data.image_size = 250
    c.lr_warmup_iters = -1
    with pytest.raises(ValueError) as err:
        config_check.validate(c)
    message = str(err.value)
    assert message.startswith("Invalid config (3 problems):\n")
    for expected in ("model.attention='flash'", "data.image_size=250", "lr_warmup_iters=-1"):
        assert expected in message


def test_data_parallel_size_resolves_minus_one_against_the_devices():
    c = toy_config.get_config()
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 2, 2
    assert config_check.data_parallel_size(c, 16) == 8  # data = 16 / (2 x 2) = 4, times fsdp 2
    c.mesh.data, c.mesh.fsdp = 2, -1
    assert config_check.data_parallel_size(c, 16) == 8


def test_batch_not_divisible_by_data_parallel_size_names_both():
    c = toy_config.get_config()
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1
    c.micro_batch_size, c.global_batch_size = 2, 6
    expected = r"global_batch_size=6 .* micro_batch_size \(2\) x data-parallel size \(4\)"
    with pytest.raises(ValueError, match=expected):
        config_check.validate(c, num_devices=4)


def test_cudnn_attention_off_nvidia_names_the_field_and_the_fix():
    c = toy_config.get_config()
    c.model.attention = "cudnn"
    config_check.validate(c, platform="cuda")
    for platform in ("cpu", "rocm"):
        with pytest.raises(ValueError, match=r"model\.attention='cudnn' .*--config\.model\.attention=auto"):
            config_check.validate(c, platform=platform)


@pytest.mark.parametrize(
    "mesh,expected",
    [
        ({"tensor": 3}, r"config\.mesh: the fixed sizes .* which does not divide the 4 devices"),
        ({"fsdp": 0}, r"config\.mesh\.fsdp must be a positive size or -1, got 0"),
        ({"fsdp": -1}, r"config\.mesh: at most one of data/fsdp/tensor may be -1"),
    ],
)
def test_mesh_that_does_not_fit_the_devices_is_a_config_error(mesh, expected):
    c = toy_config.get_config()
    c.mesh.data = -1
    for axis, size in mesh.items():
        c.mesh[axis] = size
    with pytest.raises(ValueError, match=expected):
        config_check.validate(c, num_devices=4)


def test_zero_micro_batch_is_named_not_a_division_by_zero():
    c = toy_config.get_config()
    c.micro_batch_size = 0
    with pytest.raises(ValueError, match=r"micro_batch_size=0 must be >= 1"):
        config_check.validate(c, num_devices=1)


def test_none_string_from_the_command_line_means_none():
    c = toy_config.get_config("fp8")
    c.fp8, c.recompute_granularity = "None", "none"
    config_check.none_from_command_line(c)
    assert c.fp8 is None and c.recompute_granularity is None
    c.fp8 = "hybrid"
    assert config_check.none_from_command_line(c).fp8 == "hybrid"


def test_fp8_and_rule_problems_join_the_one_error():
    c = toy_config.get_config("fp8")
    c.fp8_recipe, c.fp8_margin, c.logical_axis_rules, c.lr = "blockwise", -1, "embd=fsdp", 0.0
    with pytest.raises(ValueError) as err:
        config_check.validate(c)
    message = str(err.value)
    assert message.startswith("Invalid config (")
    for expected in ("fp8_recipe='blockwise' is not implemented", "fp8_margin=-1", "'embd=fsdp'", "lr=0.0"):
        assert expected in message
    assert "config.fp8" not in message  # fields named as on the command line, after --config.
