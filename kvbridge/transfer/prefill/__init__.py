"""The prefill side: the rooms' state machine (``machine.py`` over ``room.py`` and ``targets.py``,
fed through its door's records, ``events.py``), its request intake (``intake.py``) and writes in
flight (``writes.py``), its two small machines (``admission.py``, ``staged.py``), the endpoint
that runs it (``endpoint.py``), the engine's handle (``sender.py``) and what a decode engine can
learn of a prefill instance (``info.py``)."""

from kvbridge.transfer.prefill.config import PrefillConfig
from kvbridge.transfer.prefill.endpoint import PrefillEndpoint
from kvbridge.transfer.prefill.info import PrefillInfo
from kvbridge.transfer.prefill.sender import KVSender

__all__ = ["KVSender", "PrefillConfig", "PrefillEndpoint", "PrefillInfo"]
