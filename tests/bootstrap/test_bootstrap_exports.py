"""The bootstrap package's public surface, and the daemon command's start-up checks."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import kvbridge.bootstrap as bootstrap
from kvbridge.bootstrap.app import BootstrapSettings
from kvbridge.cli.main import main
from kvbridge.errors import ConfigError

EXPECTED = {
    "CONTRACT_PRESETS", "CP_RULES", "FINGERPRINT_PREFIX", "SPEC_ALGORITHMS", "WIRE_VERSION",
    "AuxContract", "AuxField", "KernelContract", "ModelIdentity", "PoolContract", "RuntimeContract", "SourceDigest",
    "SpeculativeContract", "canonical_json", "contract_for", "contract_from_preset",
    "fingerprint", "preset_contract", "source_digest", "weights_digest", "contract_weights", "FieldDiff", "diff_contracts", "RankIdentity", "RegisterRequest",
    "LookupResponse", "SenderRank", "MismatchRecord", "Topology", "OwnerLanePlan", "PoolDescriptor", "AuxDescriptor",
    "BootstrapClient", "Registration", "LeaseKeeper", "BootstrapSettings", "create_app",
}


def test_public_names_are_pinned_and_resolve() -> None:
    assert set(bootstrap.__all__) == EXPECTED and len(bootstrap.__all__) == len(EXPECTED)
    for name in bootstrap.__all__:
        assert getattr(bootstrap, name) is not None
    with pytest.raises(AttributeError):
        bootstrap.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "kwargs",
    [{"token": " "}, {"lease_ttl_s": 0}, {"lease_ttl_s": 400.0}, {"max_body_bytes": 10}, {"max_mismatches": 0}],
)
def test_settings_are_checked(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        BootstrapSettings(**kwargs)


def test_create_app_takes_overrides_and_refuses_typos() -> None:
    app = bootstrap.create_app(token="t", lease_ttl_s=2.0)
    assert app.title.startswith("kvbridge")
    with pytest.raises(TypeError):
        bootstrap.create_app(tokn="t")


def test_bootstrap_command_refuses_bad_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t\n")
    assert main(["bootstrap", "--port", "0", "--token", "a", "--token-file", str(token_file)]) == 2
    assert main(["bootstrap", "--port", "0", "--token-file", str(tmp_path / "absent")]) == 2
    assert main(["bootstrap", "--port", "70000"]) == 2
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        assert main(["bootstrap", "--port", str(busy.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "--token or --token-file" in err and "cannot listen" in err and "outside 0..65535" in err
