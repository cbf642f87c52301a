"""The classes SGLang gets from ``get_kv_class(TransferBackend.KVBRIDGE, ...)``.

Imported only by the ``get_kv_class`` wrapper (``patches.py``), when SGLang asks
for them: it imports SGLang. They subclass SGLang's abstract bases, so SGLang
sees the interface it expects.

Wave 1 of issue 9: the classes exist, are registered and checked against
SGLang's interface, but construct nothing yet. Their bodies, on kvbridge's
engine-facing API (issue 8), are the second wave; until then constructing one
raises ``NotImplementedError`` saying so.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
)

PENDING = (
    "kvbridge's SGLang backend is registered, but its {cls} is not implemented yet "
    "(issue 9, second wave: it needs the engine-facing API of issue 8)"
)


def _pending(obj: Any) -> NotImplementedError:
    name = obj.__name__ if isinstance(obj, type) else type(obj).__name__
    return NotImplementedError(PENDING.format(cls=name))


class KVBridgeKVManager(BaseKVManager):
    """One per SGLang scheduler rank: owns the rank's kvbridge endpoint."""

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: Any = False) -> None:
        raise _pending(type(self))

    def register_to_bootstrap(self) -> None:
        raise _pending(self)


class KVBridgeKVSender(BaseKVSender):
    """One per request on a prefill rank: a kvbridge ``KVSender``."""

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:  # fmt: skip
        raise _pending(type(self))

    def init(self, num_kv_indices: int, aux_index: Any = None) -> None:
        raise _pending(self)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: Any = None) -> None:
        raise _pending(self)

    def get_transfer_metric(self) -> Any:
        raise _pending(self)

    def poll(self) -> Any:
        raise _pending(self)

    def failure_exception(self) -> None:
        raise _pending(self)


class KVBridgeKVReceiver(BaseKVReceiver):
    """One per request on a decode rank: a kvbridge ``KVReceiver``."""

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: Any = None) -> None:
        raise _pending(type(self))

    def init(self, prefill_dp_rank: int) -> None:
        raise _pending(self)

    def send_metadata(self, kv_indices: Any, aux_index: Any = None, state_indices: Any = None,
                      decode_prefix_len: Any = None, destination: Any = None) -> None:  # fmt: skip
        raise _pending(self)

    def poll(self) -> Any:
        raise _pending(self)

    def failure_exception(self) -> None:
        raise _pending(self)


class KVBridgeKVBootstrapServer(BaseKVBootstrapServer):
    """Started by SGLang on a prefill instance (``start_disagg_service``)."""

    def __init__(self, host: str, port: int) -> None:
        raise _pending(type(self))


# KVClassType member name -> class (KVARGS stays SGLang's own KVArgs).
CLASSES: dict[str, type] = {
    "MANAGER": KVBridgeKVManager,
    "SENDER": KVBridgeKVSender,
    "RECEIVER": KVBridgeKVReceiver,
    "BOOTSTRAP_SERVER": KVBridgeKVBootstrapServer,
}
