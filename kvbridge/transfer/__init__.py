"""The data path: transfer engines (``engine/``), the control channel, the rooms'
registry both sides share (``rooms.py``), and each side's rooms as a state machine
with the endpoint that runs it and the engine's handle (``prefill/``, ``decode/``)."""

from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint, KVReceiver
from kvbridge.transfer.engine import ENGINE_KINDS, TransferEngine, WriteState, WriteStatus, create_engine, mooncake_available
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill import KVSender, PrefillConfig, PrefillEndpoint, PrefillInfo

__all__ = [
    "ENGINE_KINDS",
    "DecodeConfig",
    "DecodeEndpoint",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "PrefillConfig",
    "PrefillEndpoint",
    "PrefillInfo",
    "TransferEngine",
    "WriteState",
    "WriteStatus",
    "create_engine",
    "mooncake_available",
]
