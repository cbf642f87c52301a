"""The decode side: the rooms' state machine (``machine.py`` over ``room.py`` with its ledger,
``peers.py``, ``topologies.py``, ``staging.py`` and the commit's digest check,
``commit_digests.py``, fed through its door's records, ``events.py``), the endpoint that runs it
(``endpoint.py``) and the engine's handle (``receiver.py``)."""

from kvbridge.transfer.decode.config import DecodeConfig
from kvbridge.transfer.decode.endpoint import DecodeEndpoint
from kvbridge.transfer.decode.receiver import KVReceiver

__all__ = ["DecodeConfig", "DecodeEndpoint", "KVReceiver"]
