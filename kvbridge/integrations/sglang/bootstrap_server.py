"""``KVBridgeKVBootstrapServer``: what SGLang starts on a prefill server
(``start_disagg_service``, in the TokenizerManager process) at
``--host``:``--disaggregation-bootstrap-port``.

It runs a kvbridge bootstrap daemon there (a child process, stopped with the
server): the prefill ranks register with it and decode ranks find the prefill
instance at the request's bootstrap address. With ``KVBRIDGE_BOOTSTRAP_URL`` set
(one daemon for the cluster, run by the operator) it starts nothing.
``KVBRIDGE_BOOTSTRAP_TOKEN``, when set, is the daemon's token.
"""

from __future__ import annotations

import atexit
import contextlib
import logging

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from kvbridge import start_bootstrap
from kvbridge.integrations.sglang.settings import cluster_url

log = logging.getLogger(__name__)


class KVBridgeKVBootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int) -> None:
        self._stack = contextlib.ExitStack()
        self.url = cluster_url()
        if self.url:
            log.info("kvbridge: prefill ranks register with the cluster daemon %s", self.url)
            return
        # the daemon takes KVBRIDGE_BOOTSTRAP_TOKEN from the environment it inherits
        self.url, _ = self._stack.enter_context(start_bootstrap(host=host, port=int(port), with_token=False))
        atexit.register(self.close)
        log.info("kvbridge bootstrap daemon for this prefill instance at %s", self.url)

    def close(self) -> None:
        self._stack.close()
