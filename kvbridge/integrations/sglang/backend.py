"""The classes SGLang gets from ``get_kv_class(TransferBackend.KVBRIDGE, ...)``.

Imported only by the ``get_kv_class`` wrapper (``patches.py``), when SGLang asks
for them: the modules below import SGLang, and subclass its abstract bases so
that SGLang sees the interface it expects.

    manager.py           KVBridgeKVManager          one per scheduler rank: KVArgs -> endpoints
    sender.py            KVBridgeKVSender           one per request on a prefill rank
    receiver.py          KVBridgeKVReceiver         one per request on a decode rank
    bootstrap_server.py  KVBridgeKVBootstrapServer  the daemon of a prefill instance
"""

from __future__ import annotations

from kvbridge.integrations.sglang.bootstrap_server import KVBridgeKVBootstrapServer
from kvbridge.integrations.sglang.manager import KVBridgeKVManager
from kvbridge.integrations.sglang.receiver import KVBridgeKVReceiver
from kvbridge.integrations.sglang.sender import KVBridgeKVSender

# KVClassType member name -> class (KVARGS stays SGLang's own KVArgs).
CLASSES: dict[str, type] = {
    "MANAGER": KVBridgeKVManager,
    "SENDER": KVBridgeKVSender,
    "RECEIVER": KVBridgeKVReceiver,
    "BOOTSTRAP_SERVER": KVBridgeKVBootstrapServer,
}

__all__ = ["CLASSES", "KVBridgeKVBootstrapServer", "KVBridgeKVManager", "KVBridgeKVReceiver", "KVBridgeKVSender"]
