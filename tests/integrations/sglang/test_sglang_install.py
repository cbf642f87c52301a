"""install(): kvbridge registered as SGLang 0.5.23's transfer backend, against
SGLang's real modules (runs in .venv-sglang; skipped where SGLang is missing)."""

from __future__ import annotations

import abc
import logging
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from sglang.srt.disaggregation import utils  # noqa: E402
from sglang.srt.disaggregation.base import conn as base  # noqa: E402

import kvbridge.integrations.sglang.patches as inst  # noqa: E402
from kvbridge.integrations.sglang import SGLangMismatch, install, installed, interface_differences  # noqa: E402


@pytest.fixture(scope="module")
def sglang_with_kvbridge():
    install()
    return utils


def test_the_interface_is_sglang_0_5_23():
    assert inst.sglang_version() == "0.5.23"
    assert interface_differences() == []


def test_install_twice(sglang_with_kvbridge):
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES

    wrapper = utils.get_kv_class
    install()
    install()
    assert installed()
    assert utils.get_kv_class is wrapper and utils.get_kv_class.__wrapped__.__module__ == utils.__name__
    assert [m.name for m in utils.TransferBackend].count("KVBRIDGE") == 1
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("kvbridge") == 1
    assert interface_differences() == []  # still true once patched


def test_transfer_backend_member_behaves_like_sglangs_own(sglang_with_kvbridge):
    import pickle

    tb = utils.TransferBackend
    member = tb("kvbridge")
    assert member is tb.KVBRIDGE is tb["KVBRIDGE"] and member.value == "kvbridge" and member.name == "KVBRIDGE"
    assert isinstance(member, tb) and member in tb and list(tb)[-1] is member and len(tb) == 6
    assert pickle.loads(pickle.dumps(member)) is member
    assert tb("mooncake") is tb.MOONCAKE and tb.MOONCAKE != member
    with pytest.raises(ValueError):
        tb("kvbridge2")


def test_get_kv_class_returns_kvbridges_classes(sglang_with_kvbridge):
    from kvbridge.integrations.sglang import backend

    kinds = utils.KVClassType
    got = {kind: utils.get_kv_class(utils.TransferBackend.KVBRIDGE, kind) for kind in kinds}
    assert got == {kinds.KVARGS: base.KVArgs, kinds.MANAGER: backend.KVBridgeKVManager,
                   kinds.SENDER: backend.KVBridgeKVSender, kinds.RECEIVER: backend.KVBridgeKVReceiver,
                   kinds.BOOTSTRAP_SERVER: backend.KVBridgeKVBootstrapServer}  # fmt: skip
    for cls, parent in ((backend.KVBridgeKVManager, base.BaseKVManager), (backend.KVBridgeKVSender, base.BaseKVSender),
                        (backend.KVBridgeKVReceiver, base.BaseKVReceiver),
                        (backend.KVBridgeKVBootstrapServer, base.BaseKVBootstrapServer)):  # fmt: skip
        assert issubclass(cls, parent) and not getattr(cls, "__abstractmethods__", None)
    from sglang.srt.disaggregation.fake import FakeKVSender

    assert utils.get_kv_class(utils.TransferBackend.FAKE, kinds.SENDER) is FakeKVSender  # others untouched
    # the scheduler's modules imported get_kv_class by name before install(): re-pointed
    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.managers import disagg_service

    assert prefill.get_kv_class is decode.get_kv_class is disagg_service.get_kv_class is utils.get_kv_class


def test_server_args_accept_the_backend(sglang_with_kvbridge):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "m", "--disaggregation-mode", "prefill",
                                "--disaggregation-transfer-backend", "kvbridge"])  # fmt: skip
    assert args.disaggregation_transfer_backend == "kvbridge"
    assert utils.TransferBackend(args.disaggregation_transfer_backend) is utils.TransferBackend.KVBRIDGE


# -- against an SGLang that differs -------------------------------------------------


def _send_without_num_kv_tokens(self, kv_indices, state_indices=None):
    pass


class _StrBackend(str, __import__("enum").Enum):
    MOONCAKE = "mooncake"


@pytest.mark.parametrize(
    "target, attr, value, message",
    [
        (base.BaseKVSender, "send", _send_without_num_kv_tokens,
         r"base\.conn\.BaseKVSender\.send takes \(self, kv_indices, state_indices\), expected "
         r"\(self, kv_indices, state_indices, num_kv_tokens\)"),
        (base.BaseKVReceiver, "__abstractmethods__", base.BaseKVReceiver.__abstractmethods__ | {"release_pages"},
         r"BaseKVReceiver has abstract methods \['__init__', 'failure_exception', 'init', 'poll', 'release_pages', "
         r"'send_metadata'\]"),
        (base.KVPoll, "Success", 5, r"KVPoll is \{.*'Success': 5\}, expected .*'Success': 4\}"),
        (utils, "TransferBackend", _StrBackend, r"TransferBackend mixes in <class 'str'>; expected a plain Enum"),
        (utils, "get_kv_class", None, r"utils\.get_kv_class is not a function"),
        (utils.MetadataBuffers, "__init__", lambda self, size, hidden_size: None,
         r"MetadataBuffers\.__init__ takes \(self, size, hidden_size\), .*the aux regions would not be"),
        (base.KVArgs, "__annotations__", {k: v for k, v in base.KVArgs.__annotations__.items() if k != "kv_item_lens"},
         r"KVArgs lacks the fields \['kv_item_lens'\]"),
        (utils, "KVClassType", __import__("enum").Enum("KVClassType", {"KVARGS": "kvargs", "MANAGER": "manager"}),
         r"KVClassType\.SENDER is None, expected value 'sender'"),
    ],
    ids=["send-signature", "new-abstract-method", "kvpoll-value", "enum-kind", "get_kv_class", "metadata-buffers",
         "kvargs-field", "class-type"],
)  # fmt: skip
def test_a_different_interface_is_refused_naming_version_and_difference(monkeypatch, target, attr, value, message):
    monkeypatch.setattr(inst, "installed", lambda: False)  # as in a process not yet patched
    monkeypatch.setattr(target, attr, value)
    with pytest.raises(SGLangMismatch, match=message) as err:
        install()
    assert "SGLang 0.5.23 differs from the interface kvbridge's backend was written for" in str(err.value)
    assert err.value.field == "sglang.interface"


def test_a_missing_module_is_named(monkeypatch):
    monkeypatch.setitem(inst.SIGNATURES, "sglang.srt.disaggregation.nosuch.conn.Thing.run", ("self",))
    assert "sglang.srt.disaggregation.nosuch is missing" in interface_differences()


def test_another_version_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(inst, "installed", lambda: False)
    monkeypatch.setattr(inst, "sglang_version", lambda: "0.5.24")
    with pytest.raises(SGLangMismatch, match=r"SGLang 0\.5\.24 is installed; .* written for SGLang 0\.5\.23 "
                       r"\(set KVBRIDGE_SGLANG_UNTESTED=1 to try it anyway"):  # fmt: skip
        install()
    install(allow_untested=True)  # the interface still matches: goes on (already patched: no change)
    monkeypatch.setenv("KVBRIDGE_SGLANG_UNTESTED", "1")
    install()
    monkeypatch.setattr(inst, "sglang_version", lambda: "")
    with pytest.raises(SGLangMismatch, match="SGLang is not installed"):
        install()


def test_plugin_logs_a_mismatch_instead_of_raising(monkeypatch, caplog):
    monkeypatch.setattr(inst, "installed", lambda: False)
    monkeypatch.setattr(inst, "sglang_version", lambda: "0.6.0")
    with caplog.at_level(logging.WARNING, logger=inst.__name__):
        inst.plugin()
    assert "kvbridge is not registered as an SGLang transfer backend: SGLang 0.6.0 is installed" in caplog.text


def test_fresh_process_mismatch_patches_nothing_then_sglangs_plugin_loader_installs():
    """In a process of its own: a refused install leaves SGLang untouched; then
    SGLang's plugin loader finds kvbridge's entry point and registers the backend."""
    code = textwrap.dedent("""
        from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES as choices
        from sglang.srt.disaggregation import utils
        from sglang.srt.disaggregation.base import conn
        from kvbridge.integrations.sglang import SGLangMismatch, install, installed
        send = conn.BaseKVSender.send
        conn.BaseKVSender.send = lambda self, kv_indices: None
        original = utils.get_kv_class
        try:
            install()
        except SGLangMismatch as exc:
            print("refused:", "BaseKVSender.send takes (self, kv_indices)" in str(exc))
        print("untouched:", not installed(), "KVBRIDGE" not in utils.TransferBackend.__members__,
              "kvbridge" not in choices, utils.get_kv_class is original)
        conn.BaseKVSender.send = send
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print("plugin:", installed(), utils.TransferBackend("kvbridge").name, "kvbridge" in choices)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["refused: True", "untouched: True True True True", "plugin: True KVBRIDGE True"]


def test_abstract_base_check_sees_real_abc():
    assert isinstance(base.BaseKVSender, abc.ABCMeta)
