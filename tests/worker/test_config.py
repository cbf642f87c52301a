"""Worker configuration: flag > env > TOML > default, and --help names every setting."""

from __future__ import annotations

import argparse

import pytest

from kvbridge.cli.main import build_parser
from kvbridge.errors import ConfigError
from kvbridge.worker.config import SETTINGS, add_arguments, load_config, settings_for


def parse(role: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, role)
    return parser.parse_args(argv)


def test_precedence_flag_env_toml_default(tmp_path):
    toml = tmp_path / "w.toml"
    toml.write_text('cp_rank = 1\ncp-size = 4\nlayers = 3\npage_size = 16\n[prefill]\nlayers = 5\n')
    env = {"KVBRIDGE_CP_RANK": "2", "KVBRIDGE_CP_SIZE": "4", "KVBRIDGE_PAGE_SIZE": "32"}
    cfg = load_config("prefill", parse("prefill", ["--config", str(toml), "--cp-rank", "3"]), env)
    assert cfg.cp_rank == 3 and cfg.sources["cp_rank"] == "flag"  # flag beats env and TOML
    assert cfg.page_size == 32 and cfg.sources["page_size"] == "env"  # env beats TOML
    assert cfg.layers == 5 and cfg.sources["layers"] == "toml"  # role table beats top level
    assert cfg.dp_size == 1 and cfg.sources["dp_size"] == "default"
    assert cfg.instance == "prefill-0"


def test_config_file_from_env_and_bool_parsing(tmp_path):
    toml = tmp_path / "w.toml"
    toml.write_text("verify = false\ntrace = true\n")
    cfg = load_config("decode", parse("decode", []), {"KVBRIDGE_CONFIG": str(toml)})
    assert cfg.verify is False and cfg.trace is True
    cfg = load_config("decode", parse("decode", ["--trace", "--verify", "yes"]), {})
    assert cfg.trace is True and cfg.verify is True


@pytest.mark.parametrize(
    "argv, env, text",
    [
        (["--cp-rank", "2", "--cp-size", "2"], {}, "cp_rank"),
        (["--layers", "x"], {}, "layers"),
        ([], {"KVBRIDGE_ENGINE": "nccl"}, "engine"),
        ([], {"KVBRIDGE_BOOTSTRAP": "127.0.0.1:8998"}, "bootstrap"),
        (["--staging", "sometimes"], {}, "staging"),
        (["--staging-slot-bytes", "100"], {}, "staging_slot_bytes"),
        (["--staging-bytes", "4096", "--staging-slot-bytes", "8192"], {}, "staging_slot_bytes"),  # less than one slot
    ],
)
def test_bad_values_are_named(argv, env, text):
    with pytest.raises(ConfigError) as info:
        load_config("prefill", parse("prefill", argv), env)
    assert info.value.field == text


def test_staging_settings_from_flag_env_and_toml_with_each_roles_default(tmp_path):
    toml = tmp_path / "w.toml"
    toml.write_text('staging-slot-bytes = 1048576\n[decode]\nstaging = "always"\n')
    d = load_config("decode", parse("decode", ["--config", str(toml)]), {"KVBRIDGE_STAGING_BYTES": "8388608"})
    assert (d.staging, d.staging_bytes, d.staging_slot_bytes) == ("always", 8 << 20, 1 << 20)
    assert d.sources["staging"] == "toml" and d.sources["staging_bytes"] == "env"
    p = load_config("prefill", parse("prefill", ["--config", str(toml), "--staging", "never"]), {})
    assert p.staging == "never" and p.staging_bytes == 0  # 0: the default of the role and the pages' device
    assert load_config("decode", parse("decode", []), {}).staging_bytes == 0
    # decode's slots kept for grants sent with a room's request (DecodeConfig.staging_granted_slots)
    assert load_config("decode", parse("decode", ["--staging-granted-slots", "2"]), {}).staging_granted_slots == 2
    d = load_config("decode", parse("decode", []), {"KVBRIDGE_STAGING_GRANTED_SLOTS": "1"})
    assert d.staging_granted_slots == 1 and d.sources["staging_granted_slots"] == "env"
    with pytest.raises(ConfigError) as info:
        load_config("decode", parse("decode", ["--staging-granted-slots", "-1"]), {})
    assert info.value.field == "staging_granted_slots"


def test_staging_sizes_default_per_role_and_device():
    """0 takes the default of the role and the pages' device; a set slot size keeps the default
    number of slots; an area smaller than one slot is a named error."""
    from kvbridge.errors import ConfigError
    from kvbridge.transfer.staging.settings import staging_sizes

    assert staging_sizes("decode", False, 0, 0, "r") == (64 << 20, 8 << 20)
    assert staging_sizes("prefill", False, 0, 0, "r") == (16 << 20, 8 << 20)
    assert staging_sizes("decode", True, 0, 0, "r") == (1 << 30, 256 << 20)
    assert staging_sizes("prefill", True, 0, 0, "r") == (512 << 20, 256 << 20)
    assert staging_sizes("decode", False, 0, 1 << 20, "r") == (8 << 20, 1 << 20)
    assert staging_sizes("decode", True, 3 << 20, 1 << 20, "r") == (3 << 20, 1 << 20)
    with pytest.raises(ConfigError) as err:
        staging_sizes("decode", True, 64 << 20, 0, "r")  # one GPU slot is 256 MiB
    assert err.value.field == "staging_bytes"


def test_unknown_toml_key_is_an_error(tmp_path):
    toml = tmp_path / "w.toml"
    toml.write_text("cp_rnak = 1\n")
    with pytest.raises(ConfigError, match="cp_rnak"):
        load_config("prefill", parse("prefill", ["--config", str(toml)]), {})


def test_other_roles_keys_are_allowed_but_ignored(tmp_path):
    toml = tmp_path / "w.toml"
    toml.write_text("cp_rank = 1\ncp_size = 2\naux_rows = 8\n")
    cfg = load_config("decode", parse("decode", ["--config", str(toml)]), {})
    assert cfg.cp_rank == 0 and cfg.aux_rows == 8


@pytest.mark.parametrize("command, role", [("prefill-worker", "prefill"), ("decode-worker", "decode")])
def test_help_lists_every_setting_and_env_variable(command, role):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices[command].format_help()
    for s in settings_for(role):
        assert s.flag in text and s.env in text, s.name
    assert "--config" in text and "KVBRIDGE_CONFIG" in text


def test_secrets_are_masked_in_describe():
    cfg = load_config("prefill", {}, {"KVBRIDGE_SECRET": "hunter2", "KVBRIDGE_TOKEN": "tok"})
    assert cfg.secret_bytes == b"hunter2"
    assert "hunter2" not in cfg.describe() and "tok " not in cfg.describe()


def test_every_setting_has_help_and_unique_env():
    assert len({s.env for s in SETTINGS}) == len(SETTINGS)
    assert all(s.help for s in SETTINGS)
