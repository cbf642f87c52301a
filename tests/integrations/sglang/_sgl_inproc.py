"""One prefill server and one decode server of SGLang ranks in this process (``_sgl_world``,
``_sgl_sched``), at one cluster daemon, over real Mooncake TCP on loopback between two engines
of this process: for tests that need to act between two scheduler steps (an event to complete,
memory to release). ``close()`` stops both managers' endpoints."""

from __future__ import annotations

import time
from collections.abc import Callable

from sglang.srt.runtime_context import get_parallel

import _sgl_sched as sched
import _sgl_world as world
from _sgl_world import server_args
from _sgl_procs import CHILD_ENV, free_port

RANKS = {"attn_cp_rank": 0, "attn_cp_size": 1, "attn_tp_rank": 0, "attn_tp_size": 1, "attn_dp_rank": 0,
         "attn_dp_size": 1, "pp_rank": 0, "pp_size": 1}  # fmt: skip


class Pair:
    def __init__(self, cluster_url: str, name: str, prefill_tp: int = 1, env: dict[str, str] | None = None,
                 pp: int = 1, layers: int = world.LAYERS, stage_draft: bool = True,
                 decode_env: dict[str, str] | None = None, **args) -> None:
        """``prefill_tp``: the prefill's attention TP ranks (MLA: rank 0 sends, the others have no
        endpoint); ``env``: more environment for both servers' managers (``KVBRIDGE_*``, read once
        at start; ``decode_env``: more for decode's alone); ``pp``: the prefill's pipeline stages over a model of ``layers`` target layers
        (``stage_draft``: every stage lists the draft pool, see ``_sgl_world``; the last stage is
        built first: the others wait for its contract); ``args``: more server arguments of both
        servers (decode also gets a prefix cache, ``--disaggregation-decode-enable-radix-cache``,
        when they enable the KV checksum)."""
        from kvbridge.integrations.sglang import install

        install()
        env = {**CHILD_ENV, "KVBRIDGE_BOOTSTRAP_URL": cluster_url, **(env or {})}
        port = free_port()  # names the prefill instance (a cluster daemon: nothing listens there)
        self.addr = f"127.0.0.1:{port}"
        try:
            with world.environ(env):
                prefill_args = server_args("prefill", port, **args)
                worlds = [world.RankWorld("prefill", prefill_args, {
                    **RANKS, "attn_tp_rank": tp, "attn_tp_size": prefill_tp, "pp_rank": pp_rank, "pp_size": pp},
                    env, layers=layers, stage_draft=stage_draft)
                    for pp_rank in reversed(range(pp)) for tp in range(prefill_tp)]  # fmt: skip
                worlds.sort(key=lambda w: (w.ranks["pp_rank"], w.ranks["attn_tp_rank"]))
                self.prefill = sched.PrefillServer(name, worlds, 1, self.addr)
                decode_args = {**args, "disaggregation_decode_enable_radix_cache": True} \
                    if args.get("disaggregation_enable_kv_checksum") else args
            with world.environ({**env, **(decode_env or {})}):
                self.decode = sched.DecodeServer(f"{name}-d", world.RankWorld(
                    "decode", server_args("decode", **decode_args), RANKS, {**env, **(decode_env or {})},
                    layers=layers))  # fmt: skip
        finally:
            get_parallel().clear_stamp()

    def step(self) -> None:
        self.prefill.step()
        self.decode.step()

    def run(self, until: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not reached within {timeout:.0f}s; events: {self.events()}")
            self.step()
            time.sleep(0.002)

    def events(self) -> list[dict]:
        return [*self.prefill.events, *self.decode.events]

    def done(self, room: int) -> tuple[dict | None, dict | None]:
        found = {e["server"]: e for e in self.events() if e["room"] == room and e["event"] == "done"}
        return found.get(self.prefill.name), found.get(self.decode.name)

    def close(self) -> None:
        for w in (*self.prefill.worlds, self.decode.w):
            w.mgr.close()
