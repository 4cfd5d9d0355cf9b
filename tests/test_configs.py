import importlib
import os
import re
import subprocess
import sys

import pytest

from flux_jax import config_check, setup

CONFIGS = ("toy", "flux_535m", "flux_12b")


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("arg", [None, "fp8"])
def test_config_is_valid(name, arg):
    config = importlib.import_module(f"configs.{name}").get_config(arg)
    config_check.validate(config)
    assert (config.fp8 is not None) == (arg == "fp8")
    fp = setup.flux_params(config)
    assert fp.hidden_size % fp.num_heads == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_unknown_arg_names_file(name):
    with pytest.raises(ValueError, match=f"configs/{name}.py"):
        importlib.import_module(f"configs.{name}").get_config("fp4")


@pytest.mark.parametrize("name", ("base",) + CONFIGS)
def test_every_field_commented(name):
    with open(f"configs/{name}.py") as f:
        fields = [line for line in f if re.match(r"    c\.[\w.]+ = ", line) and "ConfigDict()" not in line]
    assert fields
    assert [line for line in fields if "#" not in line] == []


def test_recipes_follow_primus_and_mlperf():
    bf16 = importlib.import_module("configs.flux_535m").get_config()
    f8 = importlib.import_module("configs.flux_535m").get_config("fp8")
    assert (bf16.micro_batch_size, bf16.global_batch_size, f8.micro_batch_size, f8.global_batch_size) == (
        2,
        16,
        4,
        32,
    )
    assert (f8.fp8, f8.fp8_amax_history_len, f8.fp8_amax_compute_algo, f8.fp8_margin) == (
        "e4m3",
        1024,
        "most_recent",
        0,
    )
    big = importlib.import_module("configs.flux_12b").get_config("fp8")
    assert (big.lr, big.lr_warmup_iters, big.lr_decay_style, big.weight_decay) == (
        2e-4,
        1600,
        "constant",
        0.1,
    )
    assert (big.adam_beta2, big.adam_eps, big.timestep_sampling, big.data.cfg_dropout_prob) == (
        0.95,
        1e-8,
        "uniform",
        0.1,
    )
    assert big.fp8 == "hybrid"


def _train_cli(config: str, workdir, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m flux_jax.train` on CPU; each test's overrides make it stop at the config check."""
    cmd = [sys.executable, "-m", "flux_jax.train", f"--config={config}", f"--workdir={workdir}", *overrides]
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("name", CONFIGS)
def test_none_fields_can_be_set_from_the_command_line(name, tmp_path):
    # fp8 / recompute_granularity default to None; the flag parser must still accept strings for them.
    # fp8_recipe=fancy makes the run stop at the config check, so nothing is compiled.
    run = _train_cli(
        f"configs/{name}.py",
        tmp_path,
        "--config.fp8=e4m3",
        "--config.recompute_granularity=full",
        "--config.fp8_recipe=fancy",
    )
    assert run.returncode != 0
    assert "Flags parsing error" not in run.stderr
    assert "fp8_recipe='fancy' must be one of" in run.stderr


def test_fp8_none_on_the_command_line_turns_fp8_off(tmp_path):
    # train_iters=0 stops the run at the config check; fp8='None' (a string) must not be reported.
    overrides = ("--config.fp8=None", "--config.fp8_recipe=fancy", "--config.train_iters=0")
    run = _train_cli("configs/toy.py:fp8", tmp_path, *overrides)
    assert "Invalid config (1 problem):\n  - train_iters=0 must be >= 1\n" in run.stderr
    assert "fp8" not in run.stderr.split("Invalid config")[1]


def test_rules_and_blockwise_from_the_command_line_reach_the_config_check(tmp_path):
    # logical_axis_rules is a declared string field; blockwise is refused by name. train_iters=0 makes
    # the run stop at the config check whatever else passes.
    overrides = (
        "--config.logical_axis_rules=embd=fsdp",
        "--config.fp8_recipe=blockwise",
        "--config.train_iters=0",
    )
    run = _train_cli("configs/toy.py:fp8", tmp_path, *overrides)
    assert "Flags parsing error" not in run.stderr
    for expected in (
        "logical_axis_rules='embd=fsdp'",
        "fp8_recipe='blockwise' is not implemented",
        "train_iters=0",
    ):
        assert expected in run.stderr
