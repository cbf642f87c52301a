"""The look-up rate cap: one token bucket per asking decode instance.

Why look-ups are what "rooms per instance" means at the daemon: the daemon never sees a
room except through its handshake (``POST /v1/lookup``); a decode rank asks once per
room at most (it caches a DP group's topology for a couple of seconds), so look-ups
per second *are* an instance's room rate as the daemon sees it, and each costs a
contract validation and fingerprint (~1 ms of the daemon's one event loop). A
concurrency cap would mean nothing here: handlers run one at a time on that loop.
A careless or hostile instance that floods look-ups is refused with 429 and a
``Retry-After``; the other instances' handshakes keep their share.

    bucket per decode instance: capacity = burst, refilled at ``rate`` tokens/s;
    a look-up takes one token or is refused with the time until one is there.

At most ``max_keys`` buckets are kept (least recently used dropped), so random
instance names cannot grow the daemon's memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RateLimiter"]


class RateLimiter:
    def __init__(self, rate: float, burst: float | None = None, *, max_keys: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate  # 0: unlimited
        self.burst = burst if burst is not None else max(1.0, 2 * rate)
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def take(self, key: str) -> float:
        """0.0 when allowed (a token is spent), else the seconds until one is available."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
            self._buckets[key] = (tokens - 1.0 if wait == 0.0 else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        return wait
