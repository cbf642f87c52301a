"""The room endpoints move paged pools only: a window, compressed or state pool handed to an
endpoint's buffers is refused at construction, naming the pools and the field, before any
memory is registered."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import BufferSpecError
from kvbridge.layout.hybrid import deepseek_v4_pools
from kvbridge.transfer.registration import EndpointBuffers


def test_endpoint_buffers_refuse_the_kinds_the_rooms_do_not_carry():
    specs = deepseek_v4_pools(4, 16)
    bufs = {(name, lid): np.zeros(4 * spec.bytes_per_page, np.uint8).view(spec.abi if spec.abi != "bfloat16"
                                                                           else np.uint16)
            for name, spec in specs.items() for lid in spec.layer_ids}
    with pytest.raises(BufferSpecError) as err:
        EndpointBuffers(specs, bufs, rank="p0")
    assert err.value.field == "kind" and "swa (window)" in str(err.value) and "hca_tail (state)" in str(err.value)
    assert "rank=p0" in str(err.value)
