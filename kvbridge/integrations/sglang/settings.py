"""Everything the SGLang backend reads from SGLang and the environment: read once,
when a KV manager (or the bootstrap server) starts, here and nowhere else.

From SGLang: the server arguments the manager is given, the rank's place in the
attention DP x CP x TP grid (``get_parallel()``), the PD environment variables
it already has (``SGLANG_DISAGGREGATION_*``). From the environment, kvbridge's
own (``ENVIRONMENT``, also in ``kvbridge sglang --help``), through kvbridge's one settings
convention (``kvbridge.SettingsReader`` over ``KEYS``; kvbridge/integrations/README.md).

What kvbridge does not support is refused here, naming the flag, why, and (where there
is one) what to use instead: pipeline-parallel decode, the KV checksum over a pipeline-parallel
prefill, decode context parallelism (DCP),
CP-TP group sharing, the DSA cache layer split, SGLang's own staging buffer (kvbridge stages
by itself: ``KVBRIDGE_STAGING``), HiSparse, the ``prefill_complete`` allocation policy, PD role
switching, forced DP-rank queries, and metadata buffers in GPU memory on decode.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge import ConfigError, SettingsReader, contract_weights, engine_names
from kvbridge.integrations.sglang.cp_modes import lane_rule as sglang_lane_rule

ENV_URL, ENV_TOKEN, ENV_INSTANCE, ENV_HOST = ("KVBRIDGE_BOOTSTRAP_URL", "KVBRIDGE_BOOTSTRAP_TOKEN",
                                              "KVBRIDGE_INSTANCE", "KVBRIDGE_HOST")  # fmt: skip
ENV_PROTOCOL, ENV_CONTRACT, ENV_HIDDEN = "KVBRIDGE_PROTOCOL", "KVBRIDGE_CONTRACT", "KVBRIDGE_HIDDEN_DTYPE"
ENV_LEASE, ENV_PEER, ENV_SECRET = "KVBRIDGE_LEASE_TTL", "KVBRIDGE_PEER_TIMEOUT", "KVBRIDGE_SECRET"
ENV_ENGINE, ENV_WEIGHTS, ENV_LOG_LEVEL = "KVBRIDGE_ENGINE", "KVBRIDGE_WEIGHTS", "KVBRIDGE_LOG_LEVEL"
ENV_ROOM_KEY = "KVBRIDGE_ROOM_KEY"
ENGINES = engine_names("network")  # what an SGLang rank's transfer engine may be (both sides on one)
# staged transfers (docs/staging.md): the same names and meanings as the workers' settings
ENV_STAGING, ENV_STAGING_BYTES, ENV_STAGING_SLOT_BYTES = ("KVBRIDGE_STAGING", "KVBRIDGE_STAGING_BYTES",
                                                          "KVBRIDGE_STAGING_SLOT_BYTES")  # fmt: skip
ENV_STAGING_GRANTED = "KVBRIDGE_STAGING_GRANTED_SLOTS"
ENVIRONMENT = (
    (ENV_URL, "one bootstrap daemon for the whole cluster (`kvbridge bootstrap`); unset: each prefill server "
              "starts one on its --disaggregation-bootstrap-port, and decode finds it at the request's bootstrap "
              "address"),
    (ENV_TOKEN, "the daemon's bearer token, when it has one"),
    (ENV_INSTANCE, "this server's instance name at the daemon; default, prefill: its bootstrap address host:port "
                   "(what the router hands decode: a cluster daemon resolves it); decode: sglang-decode-host:port"),
    (ENV_HOST, "the address this rank's transfer engine and control socket use (default: SGLang's local IP)"),
    (ENV_ENGINE, f"the transfer engine: {' or '.join(ENGINES)} (default mooncake; nixl: NVIDIA NIXL over UCX, "
                 "kvbridge[nixl]); prefill and decode must use the same one (the daemon refuses a mismatch with the "
                 "field diff)"),
    (ENV_PROTOCOL, "Mooncake: tcp or rdma (default: rdma when --disaggregation-ib-device is set)"),
    (ENV_CONTRACT, "a runtime-contract JSON file to use instead of the one built from SGLang's pools (checked "
                   "against them)"),
    (ENV_HIDDEN, "dtype of the carried hidden state (default: --dtype, else bfloat16)"),
    (ENV_LEASE, "lease of a rank at the daemon, seconds (default 10)"),
    (ENV_PEER, "silence after which a peer rank counts as dead, and the deadline of a connection's ownership "
               "proof, seconds (default 15: a loaded host starves kvbridge's threads past 5; docs/sglang.md)"),
    (ENV_SECRET, "control-channel MAC secret, the same on every server"),
    (ENV_ROOM_KEY, "the cluster's room key, the same on every server and the router: every bootstrap_room must "
                   "then be a signed room id (kvbridge.signed_room_id; docs/sglang.md); prefill and decode refuse "
                   "an unsigned, forged or expired one by name (unset: any room id)"),
    (ENV_WEIGHTS, "the contract's weights identity: auto (default: kvbridge.weights_digest of --model-path, a "
                  "local folder or the hub cache's snapshot; names, sizes, safetensors headers and sampled chunks), "
                  "off, or a digest to use as it is; a decode whose checkpoint differs is refused by field "
                  "model.weights"),
    (ENV_LOG_LEVEL, "level of kvbridge's records, which go through SGLang's log handlers tagged with level and "
                    "process (default: SGLang's --log-level)"),
    (ENV_STAGING, "staged transfers (docs/staging.md): auto (default: chosen per target, many small slices "
                  "staged, few large ones direct), always (decode: every page through its staging area; prefill: "
                  "stage every target that offers one), never"),
    (ENV_STAGING_BYTES, "registered staging memory in bytes: decode's staging area, prefill's gather buffer "
                        "(0 or unset: host pools decode 64 MiB, prefill 16 MiB; GPU pools decode 1 GiB, prefill 512 MiB)"),
    (ENV_STAGING_SLOT_BYTES, "staging slot size in bytes, a multiple of 16: the largest chunk one write carries "
                             "(0 or unset: host pools 8 MiB, GPU pools 256 MiB)"),
    (ENV_STAGING_GRANTED, "decode: of its staging slots, how many are kept to be granted with a room's request to "
                          "each prefill rank's first chunk, written then without waiting for a grant (0 or unset: "
                          "none; docs/staging.md)"),
)
# the settings table (kvbridge.SettingsReader): KVBRIDGE_LEASE_TTL is key "lease_ttl", and so on
KEYS = {name.removeprefix("KVBRIDGE_").lower(): (name, meaning) for name, meaning in ENVIRONMENT}
WILDCARDS = ("", "0.0.0.0", "::", "[::]")
INSTANCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # what the daemon accepts
SPEC_ALGORITHMS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "nextn"}
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")


PEER_TIMEOUT_S = 15.0  # the library's 5 s is tripped by a loaded CPU host (docs/sglang.md, "Liveness")


def cluster_url(env: Mapping[str, str] | None = None) -> str:
    """The cluster daemon's URL, or "" for a daemon per prefill instance."""
    return (os.environ if env is None else env).get(ENV_URL, "").rstrip("/")


@dataclass(frozen=True)
class Settings:
    """One SGLang rank in kvbridge's terms (see the module docstring for where each comes from)."""

    role: str  # "prefill" | "decode"
    is_mla: bool
    # kvbridge coordinates: prefill (dp, cp, tp: tp 0 of 1 for MLA); decode (dp, tp)
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    tp_rank: int
    tp_size: int
    sends: bool  # prefill: this rank has an endpoint (MLA: attention TP rank 0 of its CP rank, or a KV shard;
    # MHA/GQA: every attention TP rank, each holding its heads)
    lane_rule: str  # prefill: how its CP ranks own pages
    kv_shard_size: int  # > 1: logical-page KV sharding, a rank holds logical page p as local page p // N
    # prefill: the rank's pipeline stage (SGLang's --pp-size); each stage sends its own layers
    pp_rank: int
    pp_size: int
    instance: str
    own_bootstrap: str  # prefill: "host:port" of its bootstrap address; decode: ""
    daemon_url: str  # prefill: the daemon it registers with; decode: the cluster daemon or ""
    token: str
    host: str
    protocol: str
    ib_device: str
    engine: str  # KVBRIDGE_ENGINE: mooncake | nixl
    kv_device: str
    contract_path: str
    hidden_dtype: str
    kv_checksum: bool
    model_name: str
    revision: str
    spec_algorithm: str  # kvbridge's name: none | eagle | eagle3 | nextn
    spec_topk: int
    lease_ttl: float
    peer_timeout: float
    secret: bytes | None
    bootstrap_timeout: float  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: prefill waits this long for decode
    waiting_timeout: float  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT: decode waits this long for the KV
    # staged transfers (KVBRIDGE_STAGING*): the mode, and the sizes given (0: the role's config default)
    staging: str = "auto"
    staging_bytes: int = 0
    staging_slot_bytes: int = 0
    staging_granted_slots: int = 0  # decode's KVBRIDGE_STAGING_GRANTED_SLOTS (prefill: always 0)
    model_path: str = ""
    weights: str = "auto"  # KVBRIDGE_WEIGHTS: auto | off | a digest
    log_level: str = ""  # KVBRIDGE_LOG_LEVEL ("": SGLang's)
    metrics: bool = False  # --enable-metrics: kvbridge's counters join SGLang's /metrics
    room_key: bytes = b""  # KVBRIDGE_ROOM_KEY: rooms must be signed room ids (b"": any room id)

    @property
    def staging_config(self) -> dict[str, Any]:
        """The staging keywords of this rank's ``PrefillConfig`` / ``DecodeConfig``."""
        return staging_config(self.staging, self.staging_bytes, self.staging_slot_bytes, self.staging_granted_slots)

    @property
    def label(self) -> str:
        where = f"cp{self.cp_rank}" if self.role == "prefill" else f"tp{self.tp_rank}"
        stage = f"/pp{self.pp_rank}" if self.pp_size > 1 else ""
        return f"{self.instance}/dp{self.dp_rank}/{where}{stage}"

    def daemon_for(self, bootstrap_addr: str) -> tuple[str, str | None]:
        """Decode: the daemon and the prefill instance of a request's bootstrap address. A cluster
        daemon knows prefill instances by their bootstrap address; a daemon per prefill instance
        (at that address) has one."""
        if self.daemon_url:
            return self.daemon_url, bootstrap_addr
        return f"http://{bootstrap_addr}", None


def read_settings(role: str, server_args: Any, is_mla: bool, *, gpu_id: int = 0,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Settings of one SGLang rank; ConfigError naming the flag for what kvbridge does not support."""
    env = os.environ if env is None else env
    r = SettingsReader(KEYS, None, env, where="environment")
    par = _parallel()
    sa = server_args
    _refuse_unsupported(role, sa, par, is_mla, env)
    attn = {k: int(_par(par, f"attn_{k}", 0 if k.endswith("rank") else 1))
            for k in ("dp_rank", "dp_size", "cp_rank", "cp_size", "tp_rank", "tp_size")}
    shard = _kv_shard(role, sa, attn, is_mla)
    if role == "prefill":
        if shard > 1:  # the shard group: attention TP for MLA, attention CP otherwise
            cp_rank, cp_size = (attn["tp_rank"], attn["tp_size"]) if is_mla else (attn["cp_rank"], attn["cp_size"])
            rule, sends = "interleaved", True
        else:
            cp_rank, cp_size = attn["cp_rank"], attn["cp_size"]
            rule = sglang_lane_rule(attn_cp_size=cp_size, all_cp_ranks=_sglang_env("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"))
            sends = attn["tp_rank"] == 0 or not is_mla  # MHA/GQA: each TP rank holds (and sends) its heads
        # MLA's latent is replicated over attention TP (one sender per CP rank); MHA/GQA heads are
        # sharded over it: each TP rank is a kvbridge TP rank, and decode takes head slices
        tp_rank, tp_size = (0, 1) if is_mla else (attn["tp_rank"], attn["tp_size"])
    else:
        cp_rank, cp_size, tp_rank, tp_size, rule, sends = 0, 1, attn["tp_rank"], attn["tp_size"], "interleaved", True
    host = r.text("host") or _local_ip()
    advertised = sa.host if getattr(sa, "host", "") not in WILDCARDS else host
    bootstrap_port = int(getattr(sa, "disaggregation_bootstrap_port", 8998))
    own_bootstrap = f"{advertised}:{bootstrap_port}" if role == "prefill" else ""
    node0 = str(getattr(sa, "dist_init_addr", "") or "")
    if role == "prefill":
        instance = r.text("instance") or own_bootstrap
        daemon_host = node0.rsplit(":", 1)[0] if node0 else (sa.host if sa.host not in WILDCARDS else "127.0.0.1")
        daemon = cluster_url(env) or f"http://{daemon_host}:{bootstrap_port}"
    else:
        instance = r.text("instance") or f"sglang-decode-{node0 or f'{advertised}:{sa.port}'}"
        daemon = cluster_url(env)
    if not INSTANCE_NAME.match(instance):
        raise ConfigError(f"instance name {instance!r} (from {ENV_INSTANCE} or the server's address) must match "
                          f"{INSTANCE_NAME.pattern}", field=ENV_INSTANCE)
    ib_device = str(getattr(sa, "disaggregation_ib_device", "") or "")
    spec = str(getattr(sa, "speculative_algorithm", "") or "").upper()
    if spec and spec not in SPEC_ALGORITHMS:
        raise ConfigError(f"--speculative-algorithm {spec}: kvbridge carries the draft state of "
                          f"{', '.join(SPEC_ALGORITHMS)} only", field="speculative_algorithm")
    dtype = r.choice("hidden_dtype", HIDDEN_DTYPES, sa.dtype if getattr(sa, "dtype", "") in HIDDEN_DTYPES else "bfloat16")
    secret, room_key = r.text("secret"), r.text("room_key")
    engine = r.choice("engine", ENGINES, "mooncake")
    staging = _staging(role, instance, r)
    return Settings(
        role=role, is_mla=is_mla, dp_rank=attn["dp_rank"], dp_size=attn["dp_size"], cp_rank=cp_rank, cp_size=cp_size,
        tp_rank=tp_rank, tp_size=tp_size, sends=sends, lane_rule=rule, kv_shard_size=shard,
        pp_rank=int(_par(par, "pp_rank", 0)), pp_size=int(_par(par, "pp_size", 1)), instance=instance,
        own_bootstrap=own_bootstrap, daemon_url=daemon, token=r.text("bootstrap_token"), host=host,
        protocol=r.choice("protocol", ("tcp", "rdma"), "rdma" if ib_device else "tcp"), ib_device=ib_device,
        engine=engine, kv_device=_kv_device(gpu_id), contract_path=r.text("contract"), hidden_dtype=dtype,
        kv_checksum=bool(getattr(sa, "disaggregation_enable_kv_checksum", False)),
        model_name=str(getattr(sa, "served_model_name", "") or getattr(sa, "model_path", "") or "unknown"),
        revision=str(getattr(sa, "revision", "") or "unspecified"), spec_algorithm=SPEC_ALGORITHMS.get(spec, "none"),
        spec_topk=int(getattr(sa, "speculative_eagle_topk", 0) or 1), lease_ttl=r.number("lease_ttl", 10.0, positive=True),
        peer_timeout=r.number("peer_timeout", PEER_TIMEOUT_S, positive=True), secret=secret.encode() if secret else None,
        room_key=room_key.encode(),
        bootstrap_timeout=float(_sglang_env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")),
        waiting_timeout=float(_sglang_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT")),
        model_path=str(getattr(sa, "model_path", "") or ""), weights=r.text("weights") or "auto",
        log_level=_log_level(r),
        metrics=bool(getattr(sa, "enable_metrics", False)), **staging,
    )  # fmt: skip


def _log_level(r: SettingsReader) -> str:
    level = r.text("log_level").upper()
    if level not in ("", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"{ENV_LOG_LEVEL}={level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL",
                          field=ENV_LOG_LEVEL)
    return level


def model_weights(settings: Settings) -> str:
    """The contract's ``model.weights``: ``kvbridge.weights_digest`` of --model-path (a local folder,
    or a hub id's cached snapshot at --revision) with ``KVBRIDGE_WEIGHTS`` auto; "unspecified" when
    off or when there is no local copy or no weight file (logged); the given string otherwise.
    Cost: the safetensors headers and 8 x 64 KiB per file (kvbridge.weights_digest)."""
    return contract_weights(settings.weights, settings.model_path, settings.revision)


# -- refusals ------------------------------------------------------------------------------


def refuse_checksum_of_partial_pages(kv_checksum: bool, page_size: int) -> None:
    """SGLang's KV checksum digests whole pages, the rows past a request's last token included;
    kvbridge writes only the valid rows of a partial last page (hard rule 1), so decode's rows
    there keep decode's own bytes and the two digests differ for every request whose length is
    not a multiple of the page size: with a page size above 1 the flag would abort such requests
    as mismatches, so it is refused at start-up instead (``page_size``: the KV pools' own, from
    SGLang's KVArgs)."""
    if kv_checksum and page_size > 1:
        raise ConfigError(
            f"--disaggregation-enable-kv-checksum with --page-size {page_size} is not supported by kvbridge's SGLang "
            "backend: SGLang digests whole pages, the rows past a request's last token included, and kvbridge writes "
            "only a partial last page's valid rows (never padding), so every request whose length is not a multiple "
            f"of {page_size} would be aborted as a checksum mismatch; instead serve with --page-size 1, or drop the "
            "flag (kvbridge counts every page of every layer on arrival, and its optional per-page digests cover "
            "the same rows on both sides)", field="--disaggregation-enable-kv-checksum")


def _refuse_unsupported(role: str, sa: Any, par: Any, is_mla: bool, env: Mapping[str, str]) -> None:
    checks = [
        (int(_par(par, "attn_dcp_size", 1)) > 1, "decode context parallelism (DCP)",
         "kvbridge writes whole pages into one decode rank; DCP relayouts them across ranks"),
        (bool(_par(par, "enable_cp_tp_group_sharing", False)), "--enable-cp-tp-group-sharing",
         "its CP ranks transfer as TP ranks of a CP-1 prefill; kvbridge sends per CP rank"),
        (bool(getattr(sa, "enable_dsa_cache_layer_split", False)), "--enable-dsa-cache-layer-split",
         "each CP rank would hold a share of the layers; kvbridge sends every layer from the page's owner"),
        (_sglang_env("SGLANG_DISAGG_STAGING_BUFFER"), "SGLANG_DISAGG_STAGING_BUFFER",
         "it switches SGLang's schedulers to its Mooncake backend's staging buffer (a prefetch grid on prefill, a "
         "staging handler on the KV manager), which kvbridge's backend does not implement; kvbridge stages "
         f"scattered pages by itself: unset it, and set {ENV_STAGING}=always to stage every page "
         "(default auto: chosen per target)"),
        (bool(getattr(sa, "enable_hisparse", False)), "--enable-hisparse",
         "its decode pool is host memory laid out per HiSparse page; kvbridge writes the device pool"),
        (getattr(sa, "disaggregation_decode_allocation_policy", "early") != "early",
         f"--disaggregation-decode-allocation-policy {getattr(sa, 'disaggregation_decode_allocation_policy', '')}",
         "kvbridge supports the 'early' policy (decode allocates before prefill sends)"),
        (bool(getattr(sa, "enable_pd_role_switch", False)), "--enable-pd-role-switch",
         "the kvbridge backend does not tear down and rebuild its endpoints"),
        (int(getattr(sa, "dp_size", 1) or 1) > 1 and not getattr(sa, "enable_dp_attention", False),
         "--dp-size > 1 without --enable-dp-attention",
         "kvbridge addresses a prefill DP group by its attention DP rank; give each replica its own server"),
    ]
    pp_size = int(_par(par, "pp_size", 1))
    if role == "prefill":
        checks += [
            (pp_size > 1 and bool(getattr(sa, "disaggregation_enable_kv_checksum", False)),
             "--disaggregation-enable-kv-checksum with --pp-size > 1",
             "SGLang digests each pipeline stage's own layers into that stage's metadata row, and decode receives the "
             "row of the last stage only (it holds the last hidden state), whose digest covers that stage's layers "
             "while decode digests every layer: every request would be aborted as a mismatch; instead drop the flag "
             "(kvbridge counts every page of every layer of every stage on arrival) or serve prefill with --pp-size 1"),
        ]
    if role == "decode":
        checks += [
            (pp_size > 1, "--pp-size > 1 on decode",
             "a kvbridge decode rank receives every layer of its pages (prefill may be pipeline-parallel: each stage "
             "sends its own layers); instead serve decode with --pp-size 1 (attention TP or DP for memory), or use "
             "--disaggregation-transfer-backend mooncake"),
            (_sglang_env("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"),
             "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK",
             "kvbridge finds a room's prefill DP rank by room % dp_size, or from the request's DP rank"),
            (str(_sglang_env("SGLANG_MOONCAKE_CUSTOM_MEM_POOL") or "").upper() == "INTRA_NODE_NVLINK",
             "SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK",
             "it puts decode's metadata buffers in GPU memory; kvbridge reads each room's aux row back there"),
        ]
    for bad, what, why in checks:
        if bad:
            raise ConfigError(f"{what} is not supported by kvbridge's SGLang backend: {why}", field=what.split()[0])


def _kv_shard(role: str, sa: Any, attn: dict[str, int], is_mla: bool) -> int:
    if role != "prefill" or not getattr(sa, "enable_kv_cache_sharding", False):
        return 1
    if is_mla and attn["cp_size"] > 1:
        raise ConfigError("--enable-kv-cache-sharding over attention TP together with attention CP > 1 is not "
                          "supported by kvbridge's SGLang backend: pages would have two owners", field="--enable-kv-cache-sharding")  # fmt: skip
    return attn["tp_size"] if is_mla else attn["cp_size"]


# -- SGLang and the environment ------------------------------------------------------------


def _parallel() -> Any:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def _par(par: Any, name: str, default: Any) -> Any:
    """A parallel width or rank; ``default`` where this process never set it (a single rank)."""
    try:
        return getattr(par, name)
    except (AttributeError, RuntimeError, ValueError):
        return default


def _sglang_env(name: str) -> Any:
    from sglang.srt.environ import envs

    return getattr(envs, name).get()


def _local_ip() -> str:
    from sglang.srt.utils.network import get_local_ip_auto

    return get_local_ip_auto("127.0.0.1")


def _kv_device(gpu_id: int) -> str:
    """Where SGLang's KV pools live: its GPU, or host memory on a host without one."""
    import torch

    return f"cuda:{gpu_id}" if torch.cuda.is_available() else "cpu"


def staging_config(mode: str, nbytes: int, slot_bytes: int, granted: int = 0) -> dict[str, Any]:
    """Staging keywords for a ``PrefillConfig`` / ``DecodeConfig``: sizes left out where not
    given (0), so that each role keeps its config's default (they differ by role); ``granted``
    (decode's only) where set."""
    given = {"staging_bytes": nbytes, "staging_slot_bytes": slot_bytes, "staging_granted_slots": granted}
    return {"staging": mode, **{k: v for k, v in given.items() if v}}


def _staging(role: str, instance: str, r: SettingsReader) -> dict[str, Any]:
    """The ``KVBRIDGE_STAGING*`` settings, checked by the role's own config (the one rule for
    staging settings); a refusal names the variable."""
    from kvbridge import STAGING_MODES, DecodeConfig, PrefillConfig

    out: dict[str, Any] = {"staging": r.choice("staging", STAGING_MODES, "auto"),
                           "staging_bytes": r.integer("staging_bytes", 0),
                           "staging_slot_bytes": r.integer("staging_slot_bytes", 0),
                           "staging_granted_slots": r.integer("staging_granted_slots", 0) if role == "decode" else 0}
    try:
        kw = staging_config(out["staging"], out["staging_bytes"], out["staging_slot_bytes"],
                            out["staging_granted_slots"])
        (PrefillConfig if role == "prefill" else DecodeConfig)(instance=instance, **kw)
    except ConfigError as exc:
        name = f"KVBRIDGE_{(exc.field or 'staging').upper()}"
        raise ConfigError(f"{name}: {exc.reason}", field=name) from None
    return out

