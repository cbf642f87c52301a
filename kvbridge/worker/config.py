"""Worker configuration: one table of settings, read once at start-up.

Precedence, highest first:

    command-line flag  >  KVBRIDGE_<NAME> environment variable  >  TOML file  >  default

The TOML file (``--config FILE`` or ``KVBRIDGE_CONFIG``) holds top-level keys
named like the settings (``cp_rank = 1`` or ``cp-rank = 1``); a table named
after the role (``[prefill]`` / ``[decode]``) overrides the top level for that
role only. Unknown keys are errors, never silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.layout.lanes import LANE_RULES
from kvbridge.layout.pools import PRESETS, preset_pools
from kvbridge.transfer.engine.registry import ENGINES, engine_names
from kvbridge.transfer.staging.settings import STAGING_MODES, check_staging

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROLES = ("prefill", "decode")
BOTH = frozenset(ROLES)
PREFILL = frozenset({"prefill"})
DECODE = frozenset({"decode"})
ENV_PREFIX = "KVBRIDGE_"
CONFIG_ENV = "KVBRIDGE_CONFIG"
MAX_PAGES = 2**31 - 1


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean (1/0, true/false, yes/no, on/off)")


@dataclass(frozen=True)
class Setting:
    """One configuration knob: its flag, environment variable and TOML key derive from ``name``."""

    name: str
    type: Callable[[Any], Any]
    default: Any
    help: str
    roles: frozenset[str] = BOTH
    choices: tuple[Any, ...] | None = None
    env_aliases: tuple[str, ...] = ()  # read when the main variable is unset

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def convert(self, raw: Any, source: str) -> Any:
        try:
            value = self.type(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {raw!r} is not a valid {self.name}: {exc}", field=self.name) from None
        if self.choices is not None and value not in self.choices:
            raise ConfigError(
                f"{source}: {value!r} is not one of {', '.join(map(str, self.choices))}", field=self.name
            )
        return value


SETTINGS: tuple[Setting, ...] = (
    # identity
    Setting("instance", str, "", "instance name; empty: prefill-0 / decode-0"),
    Setting("dp_rank", int, 0, "data-parallel rank of this worker"),
    Setting("dp_size", int, 1, "data-parallel size of the instance"),
    Setting("cp_rank", int, 0, "context-parallel rank of this worker", PREFILL),
    Setting("cp_size", int, 1, "context-parallel size of the instance", PREFILL),
    Setting("tp_rank", int, 0, "tensor-parallel rank of this worker"),
    Setting("tp_size", int, 1, "tensor-parallel size of the instance"),
    Setting("lane_rule", str, "interleaved", "CP owner-lane rule of the prefill instance (part of the contract)",
            choices=LANE_RULES),
    # model / pools
    Setting("preset", str, "deepseek-v3.2-fp8", "model geometry preset", choices=PRESETS),
    Setting("layers", int, 61, "target layers"),
    Setting("draft_layers", int, 1, "draft (NextN / EAGLE) layers; 0 disables the draft pool"),
    Setting("page_size", int, 64, "tokens per page"),
    Setting("pages", int, 1024, "capacity of every pool buffer, in pages"),
    Setting("aux_rows", int, 64, "rows of the decode aux buffer (one per in-flight room)", DECODE),
    # model mode (kvbridge.integrations.transformers; the 'model' extra)
    Setting("model", str, "", "run a transformers model instead of synthetic KV: tiny-qwen2, tiny-deepseek-v3 or a "
            "local Hugging Face directory (pools from the model's cache; --preset/--layers/--draft-layers unused). "
            "CP is simulated: each CP rank runs the whole prompt and stores only the pages it owns (page split, "
            "ownership, aux row and decode accounting are real, CP attention is not); so is TP: each TP rank runs "
            "the whole model and stores only its KV heads"),
    Setting("model_device", str, "cpu", "model mode: where the model runs and its pools live (cpu, cuda:N); with "
            "--protocol rdma and MC_INTRANODE_NVLINK=true (Mooncake's NVLink transport) the aux rows too"),
    Setting("model_dtype", str, "float32", "model mode: weights and KV dtype", choices=("float32", "bfloat16")),
    Setting("threads", int, 1, "model mode: torch intra-op threads (bit-equal logits need the same count and "
            "device kind on both sides)"),
    Setting("exchange_dir", str, "", "model mode: a directory shared by the decode ranks of one host (default "
            "/dev/shm/kvbridge-<instance>): each rank writes each room's rows (its KV heads) there, TP rank 0 gathers "
            "them when the pools are head-sharded (a stand-in for TP attention) and writes the room's tokens and "
            "logits; the files stay until their reader (kvbridge demo) removes them", DECODE),
    # transfer engine and network
    Setting("engine", str, "mooncake", "transfer engine: " + "; ".join(
            f"{e.name} ({e.description})" for e in ENGINES.values()) + ". Prefill and decode must run the same one "
            "(refused at the handshake otherwise)", choices=engine_names()),
    Setting("protocol", str, "tcp", "Mooncake protocol", choices=("tcp", "rdma")),
    Setting("device", str, "", "RDMA device names for Mooncake (empty: auto)"),
    Setting("host", str, "127.0.0.1", "address this worker advertises and binds"),
    Setting("control_port", int, 0, "control-channel port (0: pick a free one)", PREFILL),
    Setting("ops_port", int, 0, "ops-channel port (0: pick a free one; see --ready-file)"),
    Setting("metrics_port", int, 0, "Prometheus /metrics port (0: pick a free one, reported in the ready file; -1: off)"),
    Setting("max_slices_per_call", int, 1024, "slices per Mooncake batch call"),
    # bootstrap and security
    Setting("bootstrap", str, "http://127.0.0.1:8998", "bootstrap daemon URL, or several replicas' URLs separated by "
            "commas (any replica serves any request; the client fails over with jittered backoff)"),
    Setting("token", str, "", "bearer token for the bootstrap daemon (prefer the env variable; "
            "KVBRIDGE_BOOTSTRAP_TOKEN, the daemon's own, is read too)", env_aliases=("KVBRIDGE_BOOTSTRAP_TOKEN",)),
    Setting("secret", str, "", "cluster secret: a MAC (keyed BLAKE3) on control and ops messages (prefer the env variable)"),
    Setting("lease_ttl", float, 10.0, "bootstrap lease, seconds"),
    Setting("lease_file", str, "", "file (0600) keeping this rank's lease secret, so that a restarted worker "
            "takes its coordinates back at once; empty: a restart waits for the old lease to expire"),
    # staged transfers (docs/staging.md)
    Setting("staging", str, "auto", "staged transfers: auto (chosen per target: many small slices staged, few large "
            "ones direct), always (decode: every page through staging, an aborted room's pages free at once), never",
            choices=STAGING_MODES),
    Setting("staging_bytes", int, 0, "registered staging memory: decode's staging area (remote writes land only "
            "there), prefill's gather buffer; 0: the default for the role and the pages' device (host: decode 64 MiB, "
            "prefill 16 MiB; GPU: decode 1 GiB, prefill 512 MiB)"),
    Setting("staging_slot_bytes", int, 0, "staging slot size: the largest chunk one write carries; 0: the default "
            "for the pages' device (host 8 MiB, GPU 256 MiB)"),
    Setting("staging_granted_slots", int, 0, "of the staging area's slots, kept to be granted with a room's request to "
            "each prefill rank's first chunk, written then without waiting for a grant (0: none; held while prefill "
            "computes, never granted to a chunk that asks)", DECODE),
    # behaviour
    Setting("transfer_timeout", float, 120.0, "seconds a room may take from its op to its end"),
    Setting("drain_timeout", float, 10.0, "seconds in-flight rooms get to finish on SIGTERM"),
    Setting("verify", parse_bool, True, "verify every received byte against the synthetic KV", DECODE),
    Setting("peer_timeout", float, 5.0, "seconds a prefill rank may stay silent before its rooms fail", DECODE),
    Setting("lease_quarantine", float, 30.0, "seconds a silent prefill rank's pages stay held after its lease "
            "expired, unless it acknowledges the abort (a frozen process resumes with writes queued)", DECODE),
    Setting("poison_pages", parse_bool, False, "fill released pages with a poison byte and check them before reuse "
            "(late writes are counted in stats; burn-in and kvbridge chaos)", DECODE),
    Setting("chaos_failed_writes", int, 0, "testing: on SIGUSR1, fail the next N transfer-engine writes; "
            "on SIGUSR2, SIGKILL the process right after it posts its next write (kvbridge chaos; 0: off)"),
    Setting("ready_file", str, "", "write a JSON line with the bound endpoints here once ready"),
    Setting("trace", parse_bool, False, "log every control message and state transition"),
)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker reads from its environment, resolved once."""

    role: str
    instance: str
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    tp_rank: int
    tp_size: int
    lane_rule: str
    preset: str
    layers: int
    draft_layers: int
    page_size: int
    pages: int
    aux_rows: int
    model: str
    model_device: str
    model_dtype: str
    threads: int
    exchange_dir: str
    engine: str
    protocol: str
    device: str
    host: str
    control_port: int
    ops_port: int
    metrics_port: int
    max_slices_per_call: int
    bootstrap: str
    token: str
    secret: str
    lease_ttl: float
    lease_file: str
    staging: str
    staging_bytes: int
    staging_slot_bytes: int
    staging_granted_slots: int
    transfer_timeout: float
    drain_timeout: float
    verify: bool
    peer_timeout: float
    lease_quarantine: float
    poison_pages: bool
    chaos_failed_writes: int
    ready_file: str
    trace: bool
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def secret_bytes(self) -> bytes | None:
        return self.secret.encode() if self.secret else None

    @property
    def rank_name(self) -> str:
        cp = f"cp{self.cp_rank}" if self.role == "prefill" else ""
        return f"{self.instance}/dp{self.dp_rank}{cp}tp{self.tp_rank}"

    def describe(self) -> str:
        """One line per setting with where it came from; secrets masked."""
        lines = []
        for s in settings_for(self.role):
            value = getattr(self, s.name)
            if s.name in ("token", "secret") and value:
                value = "***"
            lines.append(f"  {s.name:<20} {value!s:<28} ({self.sources.get(s.name, 'default')})")
        return "\n".join(lines)


def settings_for(role: str) -> tuple[Setting, ...]:
    if role not in ROLES:
        raise ConfigError(f"role {role!r} is not one of {ROLES}", field="role")
    return tuple(s for s in SETTINGS if role in s.roles)


def add_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """Add ``--config`` and one flag per setting; ``--help`` names each env variable."""
    parser.add_argument("--config", metavar="FILE", default=None, help=f"TOML config file (env {CONFIG_ENV})")
    group = parser.add_argument_group("settings (flag > environment > TOML > default)")
    for s in settings_for(role):
        default = s.default if s.default != "" else "''"
        text = f"{s.help} (env {s.env}; default {default})"
        if s.type is parse_bool:
            group.add_argument(s.flag, dest=s.name, default=None, nargs="?", const="true", metavar="BOOL", help=text)
        else:
            metavar = "{" + ",".join(map(str, s.choices)) + "}" if s.choices else s.name.upper()
            group.add_argument(s.flag, dest=s.name, default=None, metavar=metavar, help=text)


def read_toml(path: str | Path, role: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}", field="config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}", field="config") from None
    known = {s.name for s in settings_for(role)}
    allowed = {s.name for s in SETTINGS}
    merged: dict[str, Any] = {}
    for scope in (data, data.get(role, {})):
        for key, value in scope.items():
            if key in ROLES and isinstance(value, dict):
                continue
            name = key.replace("-", "_")
            if name not in allowed:
                raise ConfigError(f"config file {path}: unknown key {key!r}", field=key)
            if name in known:
                merged[name] = value
    return merged


def load_config(
    role: str,
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> WorkerConfig:
    """Resolve every setting for ``role``: flag > env > TOML > default."""
    flags = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = os.environ if environ is None else environ
    config_path = flags.get("config") or env.get(CONFIG_ENV)
    toml = read_toml(config_path, role) if config_path else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in settings_for(role):
        env_name = next((e for e in (s.env, *s.env_aliases) if env.get(e) is not None), None)
        if flags.get(s.name) is not None:
            values[s.name], sources[s.name] = s.convert(flags[s.name], s.flag), "flag"
        elif env_name is not None:
            values[s.name], sources[s.name] = s.convert(env[env_name], env_name), "env"
        elif s.name in toml:
            values[s.name], sources[s.name] = s.convert(toml[s.name], f"{config_path}:{s.name}"), "toml"
        else:
            values[s.name], sources[s.name] = s.default, "default"
    for s in SETTINGS:  # settings of the other role keep their defaults
        values.setdefault(s.name, s.default)
    if not values["instance"]:
        values["instance"] = f"{role}-0"
    cfg = WorkerConfig(role=role, sources=sources, **values)
    check_config(cfg)
    return cfg


def check_config(cfg: WorkerConfig) -> None:
    for size, rank in (("dp_size", "dp_rank"), ("cp_size", "cp_rank"), ("tp_size", "tp_rank")):
        n, r = getattr(cfg, size), getattr(cfg, rank)
        if n < 1:
            raise ConfigError(f"{size} must be >= 1, got {n}", field=size)
        if not 0 <= r < n:
            raise ConfigError(f"{rank} {r} outside [0, {size}={n})", field=rank)
    for name in ("layers", "page_size", "pages", "aux_rows", "max_slices_per_call", "threads"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(cfg, name)}", field=name)
    if cfg.draft_layers < 0:
        raise ConfigError(f"draft_layers must be >= 0, got {cfg.draft_layers}", field="draft_layers")
    for name in ("pages", "aux_rows"):  # page ids and aux slots travel as int32
        if getattr(cfg, name) > MAX_PAGES:
            raise ConfigError(f"{name} {getattr(cfg, name)} is over {MAX_PAGES} (page ids are int32)", field=name)
    if cfg.chaos_failed_writes < 0:
        raise ConfigError(f"chaos_failed_writes must be >= 0, got {cfg.chaos_failed_writes}", field="chaos_failed_writes")
    for name in ("lease_ttl", "transfer_timeout", "peer_timeout"):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{name} must be > 0 seconds, got {getattr(cfg, name)}", field=name)
    if not cfg.lease_quarantine >= 0:
        raise ConfigError(f"lease_quarantine must be >= 0 seconds, got {cfg.lease_quarantine}", field="lease_quarantine")
    check_staging(cfg.staging, cfg.staging_bytes, cfg.staging_slot_bytes, cfg.rank_name, cfg.staging_granted_slots)
    if not cfg.drain_timeout >= 0:
        raise ConfigError(f"drain_timeout must be >= 0 seconds, got {cfg.drain_timeout}", field="drain_timeout")
    for name in ("control_port", "ops_port"):
        if not 0 <= getattr(cfg, name) < 65536:
            raise ConfigError(f"{name} {getattr(cfg, name)} is not a port", field=name)
    if not -1 <= cfg.metrics_port < 65536:
        raise ConfigError(f"metrics_port {cfg.metrics_port} is not a port (or -1: off)", field="metrics_port")
    for url in cfg.bootstrap.split(","):
        if not url.strip().startswith(("http://", "https://")):
            raise ConfigError(f"bootstrap URL {url.strip()!r} (of {cfg.bootstrap!r}) must start with http:// or https://",
                              field="bootstrap")
    if cfg.model and cfg.poison_pages:
        raise ConfigError("--poison-pages is for synthetic KV: model mode poisons its decode pages itself (checked "
                          "before use and past the valid rows of every room)", field="poison_pages")
    check_memory(cfg)


def pool_bytes(cfg: WorkerConfig) -> int:
    """Bytes of every pool buffer this configuration allocates."""
    specs = preset_pools(cfg.preset, num_layers=cfg.layers, page_size=cfg.page_size, draft_layers=cfg.draft_layers)
    return cfg.pages * sum(s.bytes_per_page * s.num_layers for s in specs.values())


def memory_total(meminfo: str = "/proc/meminfo") -> int | None:
    """Physical memory in bytes (Linux), or None where unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(cfg: WorkerConfig) -> None:
    """Refuse pools that cannot fit this host before allocating them (an allocation that
    fails half way, or the OOM killer, is a worse message than this one)."""
    if cfg.model:  # model mode: the pools are the model's cache, known once it is loaded
        return
    need, have = pool_bytes(cfg), memory_total()
    if have is not None and need > have:
        raise ConfigError(
            f"pools of {cfg.pages} pages x {cfg.layers}+{cfg.draft_layers} layers need {need / 2**30:.1f} GiB, "
            f"more than this host's {have / 2**30:.1f} GiB: lower --pages or --layers",
            field="pages",
        )
