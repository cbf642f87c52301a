"""Staged transfers' machinery shared by both sides (docs/staging.md).

    area.py      StagingArea: a registered area's slots as a sans-I/O state machine
                 (FREE, ASSIGNED, LANDED, SCATTERED, QUARANTINED), FIFO back-pressure
    settings.py  the staging modes, the default sizes per device, their checks
    stagers.py   HostStager (vectorised numpy), CudaStager (the slice kernel): the copies
                 between a side's pages and its slots
    buffer.py    StagingBuffer: a rank's registered staging memory beside its pages, with its
                 area and its stager (decode's staging area, prefill's gather buffer)
    writer.py    StagedWriter: both sides of a staged room in one process (tests, the bench)

The plan (which bytes go through which slot) and the choice of path are pure layout
(``kvbridge.layout.staging``); each side's rooms keep their own book of staged chunks
(``prefill/staged.py``, ``decode/staging.py``) over these.
"""

from __future__ import annotations

from kvbridge.transfer.staging.area import EVENTS, TRANSITIONS, Grant, SlotState, StagingArea
from kvbridge.transfer.staging.buffer import StagingBuffer
from kvbridge.transfer.staging.settings import STAGING_MODES, check_staging, staging_sizes
from kvbridge.transfer.staging.stagers import AddressRanges, CudaStager, HostStager, copy_slices
from kvbridge.transfer.staging.writer import StagedStats, StagedWriter

__all__ = [
    "EVENTS", "STAGING_MODES", "TRANSITIONS", "AddressRanges", "CudaStager", "Grant", "HostStager", "SlotState",
    "StagedStats", "StagedWriter", "StagingArea", "StagingBuffer", "check_staging", "copy_slices", "staging_sizes",
]
