"""The data path: transfer engines, the control channel, and the prefill and
decode endpoints with their engine-facing senders and receivers."""

from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine import ENGINE_KINDS, TransferEngine, WriteState, WriteStatus, create_engine, mooncake_available
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill import KVSender, PrefillConfig, PrefillEndpoint, PrefillInfo
from kvbridge.transfer.decode import KVReceiver

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
