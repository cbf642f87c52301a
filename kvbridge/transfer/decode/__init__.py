"""The decode side: the rooms' state machine (``machine.py`` over ``room.py``, with ``ledger.py``,
``peers.py`` and ``topologies.py``), the endpoint that runs it (``endpoint.py``) and
the engine's handle (``receiver.py``)."""

from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.endpoint import DecodeEndpoint
from kvbridge.transfer.decode.receiver import KVReceiver

__all__ = ["DecodeConfig", "DecodeEndpoint", "KVReceiver"]
