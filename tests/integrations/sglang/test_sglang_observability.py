"""Issue 31, loud failures: kvbridge's records go through SGLang's own logging configuration
(``configure_logger``) with time, level and process, INFO included when asked; refusals and
failures are counted by a bounded reason; the queue methods that make a request's sender and
receiver are wrapped (patch 5), and a handle of another backend is left alone."""

from __future__ import annotations

import logging
import types

import pytest

pytest.importorskip("sglang.srt.disaggregation.prefill", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from prometheus_client import REGISTRY  # noqa: E402
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.utils.common import configure_logger  # noqa: E402

from kvbridge import ConfigError  # noqa: E402
from kvbridge.integrations.sglang import install  # noqa: E402
from kvbridge.integrations.sglang.logs import ThroughEngine, route_logs  # noqa: E402
from kvbridge.integrations.sglang.metrics import FAILED, REFUSED, Counters, classify  # noqa: E402


@pytest.fixture
def sglang_logging():
    """SGLang's own configure_logger on the root logger; everything restored afterwards."""
    root, ours = logging.getLogger(), logging.getLogger("kvbridge")
    saved = (root.handlers[:], root.level, ours.handlers[:], ours.level, ours.propagate)
    ours.handlers, ours.propagate = [], True
    try:
        yield lambda level: configure_logger(ServerArgs(model_path="tiny", log_level=level), prefix=" TP3")
    finally:
        root.handlers, root.level = saved[0], saved[1]
        ours.handlers, ours.level, ours.propagate = saved[2], saved[3], saved[4]


def test_records_carry_time_level_and_process_through_sglangs_handlers(sglang_logging, capsys):
    sglang_logging("info")
    route_logs(None)
    route_logs(None)  # idempotent: one handler
    assert [type(h) for h in logging.getLogger("kvbridge").handlers] == [ThroughEngine]
    logging.getLogger("kvbridge.integrations.sglang.handles").warning("room %d on %s: refused", 7, "p0")
    logging.getLogger("kvbridge.integrations.sglang.manager").info("rank ready")
    logging.getLogger("kvbridge.integrations.sglang.manager").debug("not asked")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("[20") and " TP3] WARNING kvbridge.integrations.sglang.handles (pid " in lines[0]
    assert lines[0].endswith("): room 7 on p0: refused"), lines[0]
    assert " TP3] INFO kvbridge.integrations.sglang.manager (pid " in lines[1]


def test_kvbridge_log_level_asks_for_more_than_sglangs(sglang_logging, capsys):
    sglang_logging("warning")
    route_logs("DEBUG")
    logging.getLogger("kvbridge.x").debug("asked for")
    logging.getLogger("sglang.y").info("SGLang's own info stays hidden")
    err = capsys.readouterr().err
    assert "DEBUG kvbridge.x (pid " in err and "asked for" in err and "hidden" not in err
    with pytest.raises(ConfigError, match="KVBRIDGE_LOG_LEVEL 'LOUD'"):
        route_logs("LOUD")


@pytest.mark.parametrize("text, counted", [
    ("room 5 is open: a KVSender still holds it (Bootstrapping)", (REFUSED, "room_in_use")),
    ("room 5 on prefill rank p/cp0 is bound to another request (binding ab): decode rank d presented binding cd",
     (REFUSED, "bound_to_another_request")),
    ("room 5 was claimed with binding ab before the engine opened it with cd: the claim is another request's",
     (REFUSED, "bound_to_another_request")),
    ("decode rank d/tp0 says 151 tokens, but the room was started with 150 tokens", (REFUSED, "token_count")),
    ("contract mismatch: model.weights differs", (REFUSED, "contract")),
    ("aborted by SGLang (AbortReq)", (FAILED, "aborted")),
    ("prefill rank p/cp0 silent for 15.0s", (FAILED, "peer_lost")),
    ("something new", (FAILED, "other")),
])  # fmt: skip
def test_reasons_are_a_bounded_set(text, counted):
    assert classify(text) == counted


def test_counters_join_the_process_registry_once():
    first = Counters("prefill", shared=True)
    second = Counters("prefill", shared=True)  # a second manager in this process: a registry of its own
    assert first.registry is REGISTRY and second.registry is not REGISTRY
    before = first.value(REFUSED, "room_in_use")
    assert first.count("room 9 is open: a KVSender still holds it") == (REFUSED, "room_in_use")
    assert REGISTRY.get_sample_value(REFUSED, {"role": "prefill", "reason": "room_in_use"}) == before + 1
    assert second.value(REFUSED, "room_in_use") == 0


def test_the_queue_methods_are_wrapped_and_other_backends_left_alone():
    install()
    assert getattr(PrefillBootstrapQueue.create_sender, "__kvbridge_backend__", False)
    calls = []
    other = types.SimpleNamespace()  # another backend's sender: no bind_request
    queue = types.SimpleNamespace(_check_if_req_exceed_kv_capacity=lambda _r: False, _process_req=lambda _r: None,
                                  bootstrap_port=1, kv_manager=None, transfer_backend=None)
    req = types.SimpleNamespace(bootstrap_host="h", bootstrap_room=1, disagg_prefill_dp_rank=None,
                                origin_input_ids=[1, 2])

    def make(*_a, **_k):
        calls.append("made")
        return other

    import sglang.srt.disaggregation.prefill as prefill

    saved = prefill.get_kv_class
    prefill.get_kv_class = lambda *_a: make
    try:
        assert PrefillBootstrapQueue.create_sender(queue, req, 0)
    finally:
        prefill.get_kv_class = saved
    assert calls == ["made"] and req.disagg_kv_sender is other and vars(other) == {}
