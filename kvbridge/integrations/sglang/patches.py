"""Registering kvbridge as SGLang's transfer backend ``kvbridge``: the one place
that patches SGLang.

SGLang 0.5.23 picks a PD transfer backend with ``--disaggregation-transfer-backend``
and has no registry for out-of-tree backends. These patches make ``kvbridge`` one:

1. ``TransferBackend`` (``sglang.srt.disaggregation.utils``) is a closed ``Enum``
   that SGLang builds from the flag (``TransferBackend(name)``, in the scheduler
   and the bootstrap-server start-up). ``install()`` adds the member
   ``TransferBackend.KVBRIDGE = "kvbridge"`` the way ``enum`` builds its own
   members (``_add_member``): afterwards ``TransferBackend("kvbridge")``,
   ``TransferBackend["KVBRIDGE"]``, iteration, ``len`` and pickling behave as
   for a built-in member. The members SGLang defines are untouched.
2. ``get_kv_class`` (same module) maps ``(backend, class type)`` to classes with
   an if-chain. It is wrapped: ``KVBRIDGE`` gets kvbridge's manager, sender,
   receiver and bootstrap server (``kvbridge.integrations.sglang.backend``);
   every other backend, and every ``KVARGS`` request, goes to SGLang's own
   function. SGLang's modules that imported the function by name before
   ``install()`` (``prefill``, ``decode``, ``disagg_service``...) are re-pointed,
   as SGLang's own ``HookRegistry`` does; no module outside ``sglang.*`` is touched.
3. The flag's choices: ``add_disagg_transfer_backend_choices(["kvbridge"])``,
   SGLang's own extension point (``sglang.srt.arg_groups.choices``).
4. ``SGLANG_HTTP_SERVER_APP_PATH``, when unset (or SGLang's default), names
   ``kvbridge.integrations.sglang.http_app:app``: SGLang's extra tokenizer worker
   processes (``--tokenizer-worker-num > 1``) import that app and run no plugin
   loader; kvbridge's app registers the backend there first (``http_app.py``).
   Set to another app, it is left alone with a warning: that app must call
   ``install()``.

5. Rooms bound to their request: SGLang makes a request's sender in
   ``PrefillBootstrapQueue.create_sender(req, ...)`` and its receiver in
   ``DecodePreallocQueue._create_receiver_and_enqueue(req, ...)``, handing them only the room
   id. Both methods are wrapped on their classes: after SGLang's own body, a kvbridge
   sender/receiver gets ``bind_request(req)`` (``handles.py``): prefill binds the room to the
   digest of the request's prompt token ids and count (``kvbridge.room_binding``), decode
   presents its own with the claim, so a room id taken from another request is refused by
   name, nothing written or read. Other backends' handles are left alone.
6. ``DecodePreallocQueue._send_kv_metadata`` (``sglang.srt.disaggregation.decode``) is wrapped
   to hand a kvbridge receiver the request's token count before SGLang's ``send_metadata``
   (``_hook_decode_token_count``): window and state pools need it; nothing else changes.
7. ``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager`` are
   wrapped to name the queue building the manager (``building.building_queue``): an SWA pool's window
   and layers are read off it, as ``KVArgs`` do not carry them (``_hook_init_kv_manager``).

``install()`` is idempotent. It first checks the installed SGLang: its version
must be one of ``SUPPORTED_VERSIONS`` (``allow_untested=True`` or
``KVBRIDGE_SGLANG_UNTESTED=1`` waives this one check), and every name, signature
and value kvbridge patches, subclasses or calls must be as in 0.5.23
(``interface_differences()``). Any difference raises ``SGLangMismatch`` naming
the SGLang version and each difference; nothing is patched then.

SGLang starts its scheduler, data-parallel and detokenizer processes with
``spawn``, so a patch made in the launching process does not reach them. Each
of those processes runs SGLang's plugin loader (``load_plugins()``), which calls
the functions registered under the entry-point group ``sglang.srt.plugins``;
kvbridge registers ``plugin()`` there (pyproject.toml), and ``plugin()`` calls
``install()``. So a host where kvbridge is installed next to SGLang accepts
``--disaggregation-transfer-backend kvbridge`` in ``sglang serve`` as well as in
``kvbridge sglang``. ``SGLANG_PLUGINS``, when set, must name ``kvbridge``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from enum import Enum
from typing import Any

from kvbridge import ConfigError
from kvbridge.integrations.sglang.version import SUPPORTED_VERSIONS, sglang_version

logger = logging.getLogger(__name__)

BACKEND = "kvbridge"  # the value of --disaggregation-transfer-backend
MEMBER = "KVBRIDGE"  # TransferBackend.KVBRIDGE
UNTESTED_ENV = "KVBRIDGE_SGLANG_UNTESTED"
_MARK = "__kvbridge_backend__"  # set on the get_kv_class wrapper

_UTILS = "sglang.srt.disaggregation.utils"
_BASE = "sglang.srt.disaggregation.base.conn"
_COMMON = "sglang.srt.disaggregation.common.conn"
_CHOICES = "sglang.srt.arg_groups.choices"
_DECODE = "sglang.srt.disaggregation.decode"
_PREFILL = "sglang.srt.disaggregation.prefill"
_PREFILL_QUEUE = f"{_PREFILL}.PrefillBootstrapQueue"
_DECODE_QUEUE = f"{_DECODE}.DecodePreallocQueue"
# patch 5: the queue methods that make a request's sender / receiver, and where it lands
BINDS = {f"{_PREFILL_QUEUE}.create_sender": "disagg_kv_sender", f"{_DECODE_QUEUE}._create_receiver_and_enqueue": ""}
REQ_FIELDS = ("origin_input_ids", "bootstrap_room")  # what bind_request reads of SGLang's Req
APP_PATH_ENV = "SGLANG_HTTP_SERVER_APP_PATH"
APP_PATH = "kvbridge.integrations.sglang.http_app:app"  # patch 4: what the HTTP workers import
SGLANG_APP_PATH = "sglang.srt.entrypoints.http_server:app"  # SGLang's default, handed back by http_app

# What kvbridge calls, overrides or subclasses: dotted name -> parameter names.
SIGNATURES: dict[str, tuple[str, ...]] = {
    f"{_UTILS}.get_kv_class": ("transfer_backend", "class_type"),
    f"{_BASE}.BaseKVManager.__init__": ("self", "args", "disaggregation_mode", "server_args", "is_mla_backend"),
    f"{_BASE}.BaseKVManager.register_to_bootstrap": ("self",),
    f"{_BASE}.BaseKVSender.__init__": ("self", "mgr", "bootstrap_addr", "bootstrap_room",
                                       "req_has_disagg_prefill_dp_rank"),
    f"{_BASE}.BaseKVSender.init": ("self", "num_kv_indices", "aux_index"),
    f"{_BASE}.BaseKVSender.send": ("self", "kv_indices", "state_indices", "num_kv_tokens"),
    f"{_BASE}.BaseKVSender.poll": ("self",),
    f"{_BASE}.BaseKVSender.failure_exception": ("self",),
    f"{_BASE}.BaseKVSender.get_transfer_metric": ("self",),
    f"{_BASE}.BaseKVSender.pop_decode_prefix_len": ("self",),
    f"{_BASE}.BaseKVSender.should_send_kv_chunk": ("self", "num_pages", "last_chunk"),
    f"{_BASE}.BaseKVSender.clear": ("self",),
    f"{_BASE}.BaseKVSender.abort": ("self",),
    f"{_BASE}.BaseKVReceiver.__init__": ("self", "mgr", "bootstrap_addr", "bootstrap_room"),
    f"{_BASE}.BaseKVReceiver.init": ("self", "prefill_dp_rank"),
    f"{_BASE}.BaseKVReceiver.send_metadata": ("self", "kv_indices", "aux_index", "state_indices",
                                              "decode_prefix_len", "destination"),
    f"{_BASE}.BaseKVReceiver.poll": ("self",),
    f"{_BASE}.BaseKVReceiver.failure_exception": ("self",),
    f"{_BASE}.BaseKVReceiver.clear": ("self",),
    f"{_BASE}.BaseKVReceiver.abort": ("self",),
    f"{_BASE}.BaseKVBootstrapServer.__init__": ("self", "host", "port"),
    f"{_COMMON}.KVTransferError.__init__": ("self", "bootstrap_room", "failure_reason", "is_from_another_rank"),
    f"{_COMMON}.PrefillServerInfo.__init__": ("self", "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size",
                                              "kv_cache_dtype", "follow_bootstrap_room", "enable_dsa_cache_layer_split",
                                              "dsv41_spec_layout", "kv_layout", "decode_allocation_policy",
                                              "enable_kv_cache_sharding", "prefill_http_port", "target_tp_rank",
                                              "target_tp_ranks", "target_cp_ranks", "target_pp_ranks",
                                              "required_dst_info_num", "required_prefill_response_num"),
    f"{_BASE}.KVTransferMetric.__init__": ("self", "transfer_latency_s", "alloc_latency_s", "transfer_total_bytes"),
    "sglang.srt.runtime_context.get_parallel": (),
    "sglang.srt.utils.network.get_local_ip_auto": ("fallback",),
    f"{_UTILS}.MetadataBuffers.get_buf_infos": ("self",),
    f"{_CHOICES}.add_disagg_transfer_backend_choices": ("iterable",),
    "sglang.srt.plugins.load_plugins": (),
    f"{_PREFILL_QUEUE}.create_sender": ("self", "req", "num_kv_heads"),
    f"{_DECODE_QUEUE}._create_receiver_and_enqueue": ("self", "req", "is_rebootstrap"),
    "sglang.cli.serve.serve": ("args", "extra_argv"),
    f"{_DECODE}.DecodePreallocQueue._send_kv_metadata": ("self", "decode_req", "kv_indices", "page_size",
                                                        "state_indices", "metadata_kwargs"),
    f"{_DECODE}.DecodePreallocQueue._rebootstrap_prefill_len": ("req",),
    f"{_DECODE}.DecodePreallocQueue._init_kv_manager": ("self",),
    f"{_PREFILL}.PrefillBootstrapQueue._init_kv_manager": ("self",),
}  # fmt: skip

# Abstract methods of the base classes kvbridge's classes implement.
ABSTRACT: dict[str, frozenset[str]] = {
    f"{_BASE}.BaseKVManager": frozenset({"__init__", "register_to_bootstrap"}),
    f"{_BASE}.BaseKVSender": frozenset({"__init__", "init", "send", "get_transfer_metric", "poll",
                                        "failure_exception"}),
    f"{_BASE}.BaseKVReceiver": frozenset({"__init__", "init", "send_metadata", "poll", "failure_exception"}),
    f"{_BASE}.BaseKVBootstrapServer": frozenset({"__init__"}),
}  # fmt: skip

# Enums whose members kvbridge names: dotted name -> {member: value}.
ENUMS: dict[str, dict[str, Any]] = {
    f"{_UTILS}.KVClassType": {"KVARGS": "kvargs", "MANAGER": "manager", "SENDER": "sender",
                              "RECEIVER": "receiver", "BOOTSTRAP_SERVER": "bootstrap_server"},
    f"{_BASE}.StateType": {"DSA": "dsa"},
    f"{_BASE}.KVTransferDestination": {"DEVICE": "device"},
}  # fmt: skip
KVPOLL = {"Failed": 0, "Bootstrapping": 1, "WaitingForInput": 2, "Transferring": 3, "Success": 4}

# KVArgs fields the translation (kvbridge.integrations.sglang.kvargs) reads.
KVARGS_FIELDS = (
    "engine_rank", "kv_data_ptrs", "kv_data_lens", "kv_item_lens", "kv_layer_ids", "kv_cache_dtype_str",
    "aux_data_ptrs", "aux_data_lens", "aux_item_lens", "state_types", "state_data_ptrs", "state_data_lens",
    "state_item_lens", "page_size", "pp_rank", "prefill_start_layer", "prefill_end_layer", "num_draft_entries",
    "ib_device", "gpu_id",
)  # fmt: skip

# SGLang's PD environment variables the backend reads (settings.py).
SGLANG_ENVS = (
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK",
    "SGLANG_DISAGG_STAGING_BUFFER", "SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "SGLANG_HTTP_SERVER_APP_PATH",
)  # fmt: skip

# MetadataBuffers' constructor: the aux regions follow from these.
METADATA_INIT = ("self", "size", "hidden_size", "hidden_states_dtype", "max_sampling_mask_tokens",
                 "max_top_logprobs_num", "custom_mem_pool", "output_dsa_topk_indices_dim", "kv_checksum_enabled")  # fmt: skip


class SGLangMismatch(ConfigError):
    """The installed SGLang is not the version, or does not have the interface,
    that kvbridge's backend was written for."""


def installed() -> bool:
    """Whether ``install()`` has run in this process (every patch in place)."""
    utils = sys.modules.get(_UTILS)
    if utils is None:
        return False
    member = getattr(utils.TransferBackend, "_member_map_", {}).get(MEMBER)
    return member is not None and getattr(utils.get_kv_class, _MARK, False)


def install(*, allow_untested: bool = False) -> None:
    """Register kvbridge as SGLang's transfer backend ``kvbridge`` (see the module
    docstring). Idempotent; raises ``SGLangMismatch`` and patches nothing when the
    installed SGLang differs from what the backend was written for."""
    if installed():
        return
    version = sglang_version()
    if not version:
        raise SGLangMismatch(
            f"SGLang is not installed; kvbridge's backend supports SGLang {', '.join(SUPPORTED_VERSIONS)} "
            f"(pip install 'sglang=={SUPPORTED_VERSIONS[-1]}')",
            field="sglang",
        )
    untested = allow_untested or os.environ.get(UNTESTED_ENV, "") not in ("", "0")
    if version not in SUPPORTED_VERSIONS and not untested:
        raise SGLangMismatch(
            f"SGLang {version} is installed; kvbridge's backend is written for SGLang "
            f"{', '.join(SUPPORTED_VERSIONS)} (set {UNTESTED_ENV}=1 to try it anyway: the interface is still checked)",
            field="sglang.version",
        )
    differences = interface_differences()
    if differences:
        raise SGLangMismatch(
            f"SGLang {version} differs from the interface kvbridge's backend was written for (SGLang "
            f"{', '.join(SUPPORTED_VERSIONS)}): " + "; ".join(differences),
            field="sglang.interface",
        )
    utils = importlib.import_module(_UTILS)
    member = _add_member(utils.TransferBackend, MEMBER, BACKEND)
    _wrap_get_kv_class(utils, member)
    _hook_decode_token_count(importlib.import_module(_DECODE).DecodePreallocQueue)
    for queue in (importlib.import_module(_PREFILL).PrefillBootstrapQueue,
                  importlib.import_module(_DECODE).DecodePreallocQueue):
        _hook_init_kv_manager(queue)
    choices = importlib.import_module(_CHOICES)
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    _point_http_workers_at_kvbridge()
    _bind_rooms_to_requests()
    logger.debug("kvbridge registered as SGLang %s transfer backend %r", version, BACKEND)


def plugin() -> None:
    """SGLang's plugin loader calls this in every SGLang process (entry point
    ``sglang.srt.plugins: kvbridge``). A mismatch is logged, not raised: SGLang
    then serves its own backends, and ``--disaggregation-transfer-backend
    kvbridge`` is refused as an unknown choice after this warning. kvbridge's records of every
    SGLang process go through SGLang's log handlers from here on (``logs.route_logs``; the level:
    SGLang's, or ``KVBRIDGE_LOG_LEVEL`` once a KV manager read it)."""
    from kvbridge.integrations.sglang.logs import route_logs  # only in SGLang's processes

    route_logs(None)
    try:
        install()
    except SGLangMismatch as exc:
        logger.warning("kvbridge is not registered as an SGLang transfer backend: %s", exc)


# -- the interface check ---------------------------------------------------------


def interface_differences() -> list[str]:
    """Every way the installed SGLang differs from the 0.5.23 interface the
    backend relies on, one phrase each (empty when it matches)."""
    out: list[str] = []
    for name, params in SIGNATURES.items():
        obj, err = _resolve(name)
        if err:
            out.append(err)
            continue
        found = _params(obj)
        if found is None:
            out.append(f"{name} is not a function")
        elif found != params:
            out.append(f"{name} takes ({', '.join(found)}), expected ({', '.join(params)})")
    for name, expected in ABSTRACT.items():
        cls, err = _resolve(name)
        if err:
            out.append(err)
        elif frozenset(getattr(cls, "__abstractmethods__", ())) != expected:
            found = sorted(getattr(cls, "__abstractmethods__", ()))
            out.append(f"{name} has abstract methods {found}, expected {sorted(expected)}")
    for name, members in ENUMS.items():
        cls, err = _resolve(name)
        if err:
            out.append(err)
            continue
        for member, value in members.items():
            found = getattr(cls, member, None)
            if getattr(found, "value", None) != value:
                out.append(f"{name}.{member} is {found!r}, expected value {value!r}")
    poll, err = _resolve(f"{_BASE}.KVPoll")
    if err:
        out.append(err)
    else:
        found_poll = {k: getattr(poll, k, None) for k in KVPOLL}
        if found_poll != KVPOLL:
            out.append(f"{_BASE}.KVPoll is {found_poll}, expected {KVPOLL}")
    kvargs, err = _resolve(f"{_BASE}.KVArgs")
    if err:
        out.append(err)
    else:
        missing = [f for f in KVARGS_FIELDS if f not in getattr(kvargs, "__annotations__", {})]
        if missing:
            out.append(f"{_BASE}.KVArgs lacks the fields {missing}")
    metadata, err = _resolve(f"{_UTILS}.MetadataBuffers.__init__")
    if err:
        out.append(err)
    elif _params(metadata) != METADATA_INIT:
        out.append(f"{_UTILS}.MetadataBuffers.__init__ takes ({', '.join(_params(metadata) or ())}), "
                   f"expected ({', '.join(METADATA_INIT)}): the aux regions would not be the ones kvbridge maps")
    envs, err = _resolve("sglang.srt.environ.envs")
    if err:
        out.append(err)
    else:
        missing_envs = [name for name in SGLANG_ENVS if not hasattr(envs, name)]
        if missing_envs:
            out.append(f"sglang.srt.environ.envs lacks {missing_envs}")
    req_init, err = _resolve("sglang.srt.managers.schedule_batch.Req.__init__")
    if err:
        out.append(err)
    else:
        missing_req = [f for f in REQ_FIELDS if f not in (_params(req_init) or ())]
        if missing_req:
            out.append(f"sglang.srt.managers.schedule_batch.Req takes no {missing_req}: kvbridge binds a room to them")
    out.extend(_transfer_backend_differences())
    choices, err = _resolve(f"{_CHOICES}.DISAGG_TRANSFER_BACKEND_CHOICES")
    if err:
        out.append(err)
    elif not isinstance(choices, list):
        out.append(f"{_CHOICES}.DISAGG_TRANSFER_BACKEND_CHOICES is a {type(choices).__name__}, expected a list")
    group, err = _resolve("sglang.srt.plugins.GENERAL_PLUGINS_GROUP")
    if err:
        out.append(err)
    elif group != "sglang.srt.plugins":
        out.append(f"SGLang's plugin entry-point group is {group!r}, expected 'sglang.srt.plugins'")
    return out


def _transfer_backend_differences() -> list[str]:
    name = f"{_UTILS}.TransferBackend"
    cls, err = _resolve(name)
    if err:
        return [err]
    if not (isinstance(cls, type) and issubclass(cls, Enum)):
        return [f"{name} is not an Enum"]
    out = []
    if getattr(cls, "_member_type_", None) is not object:
        out.append(f"{name} mixes in {getattr(cls, '_member_type_', None)!r}; expected a plain Enum")
    for attr, kind in (("_member_names_", list), ("_member_map_", dict), ("_value2member_map_", dict)):
        if not isinstance(getattr(cls, attr, None), kind):
            out.append(f"{name}.{attr} is not a {kind.__name__} (this Python's enum is not the one kvbridge extends)")
    by_value = getattr(cls, "_value2member_map_", {})
    existing = by_value.get(BACKEND) if isinstance(by_value, dict) else None
    if existing is not None and existing.name != MEMBER:
        out.append(f"{name} already has a member {existing.name} = {BACKEND!r}")
    if getattr(cls, "MOONCAKE", None) is None:
        out.append(f"{name} has no MOONCAKE member")
    return out


def _resolve(dotted: str) -> tuple[Any, str]:
    """The object at a dotted path, importing its module; ``(None, phrase)`` when missing."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as exc:
            if cut == 1 or not _is_missing_module(exc, module_name):
                return None, f"{module_name} does not import ({exc})"
            continue
        for i, attr in enumerate(parts[cut:]):
            if not hasattr(obj, attr):
                return None, f"{'.'.join(parts[: cut + i + 1])} is missing"
            obj = getattr(obj, attr)
        return obj, ""
    return None, f"{dotted} is missing"


def _is_missing_module(exc: ImportError, name: str) -> bool:
    return isinstance(exc, ModuleNotFoundError) and exc.name is not None and name.startswith(exc.name)


def _params(obj: Any) -> tuple[str, ...] | None:
    if not callable(obj):
        return None
    try:
        return tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


# -- the patches -------------------------------------------------------------------


def _add_member(enum_cls: type[Enum], name: str, value: str) -> Enum:
    """Add ``name = value`` to a plain ``Enum`` after its creation, filling the same
    tables ``enum`` fills for members it builds (checked by ``interface_differences``)."""
    existing = enum_cls._member_map_.get(name)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls  # type: ignore[attr-defined]
    member._sort_order_ = len(enum_cls._member_names_)  # type: ignore[attr-defined]
    type.__setattr__(enum_cls, name, member)  # EnumType.__setattr__ only refuses re-binding a member
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)  # type: ignore[attr-defined]
    return member


def _wrap_get_kv_class(utils: Any, member: Enum) -> None:
    original: Callable[..., Any] = utils.get_kv_class
    if getattr(original, _MARK, False):
        return
    kvargs_type = utils.KVClassType.KVARGS

    @functools.wraps(original)
    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend is member and class_type != kvargs_type:
            from kvbridge.integrations.sglang import backend

            return backend.CLASSES.get(class_type.name)
        return original(transfer_backend, class_type)

    setattr(get_kv_class, _MARK, True)
    utils.get_kv_class = get_kv_class
    for module in sglang_modules_holding(original):
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, get_kv_class)


def _hook_decode_token_count(queue: type) -> None:
    """5. Decode's token count. SGLang's ``send_metadata`` says a request's pages, not its tokens,
    and kvbridge's window and state pools need the count (it decides the window and the complete
    entries; prefill checks it). ``DecodePreallocQueue._send_kv_metadata`` is wrapped: for a
    kvbridge receiver it first sets ``num_tokens`` to the length prefill sends
    (``_rebootstrap_prefill_len``, SGLang's own) and its request (the request row of a tail slot
    SGLang sends no index for at a block boundary), then runs SGLang's method unchanged."""
    original = queue._send_kv_metadata
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _send_kv_metadata(self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
        receiver = getattr(decode_req, "kv_receiver", None)
        if hasattr(receiver, "num_tokens") and getattr(receiver, "__kvbridge_receiver__", False):
            receiver.num_tokens = int(queue._rebootstrap_prefill_len(decode_req.req))
            receiver.request = decode_req.req  # its request row: a tail slot SGLang sends no index for
        return original(self, decode_req, *args, **kwargs)

    setattr(_send_kv_metadata, _MARK, True)
    queue._send_kv_metadata = _send_kv_metadata


def _hook_init_kv_manager(queue: type) -> None:
    """6. The hybrid geometry. ``KVArgs`` do not say an SWA pool's window or its layers; the
    queue that builds the manager holds the pool and the scheduler. ``_init_kv_manager`` is
    wrapped to name that queue (``building_queue()``) while SGLang's own method runs; the manager
    reads the geometry off it (``state_kinds.geometry_of``)."""
    original = queue._init_kv_manager
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _init_kv_manager(self: Any) -> Any:
        from kvbridge.integrations.sglang.building import building

        with building(self):
            return original(self)

    setattr(_init_kv_manager, _MARK, True)
    queue._init_kv_manager = _init_kv_manager


def sglang_modules_holding(function: Callable[..., Any]) -> list[Any]:
    """SGLang's own modules (``sglang`` and ``sglang.*``, ``utils`` excepted) with a global
    bound to ``function``: ``from ...utils import get_kv_class`` copied it into those imported
    before ``install()``, and they are re-pointed at the wrapper. Only SGLang's: a user's
    module that kept SGLang's function on purpose keeps it."""
    out = []
    for name, module in list(sys.modules.items()):
        if name == _UTILS or not (name == "sglang" or name.startswith("sglang.")):
            continue
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and any(value is function for value in namespace.values()):
            out.append(module)
    return out


def _bind_rooms_to_requests() -> None:
    """Patch 5 (module docstring): wrap the two queue methods in their classes, once."""
    for name, attr in BINDS.items():
        owner, _, method = name.rpartition(".")
        cls, _ = _resolve(owner)
        original = cls.__dict__[method]
        if getattr(original, _MARK, False):
            continue
        setattr(cls, method, _binding_wrapper(original, attr))


def _binding_wrapper(original: Callable[..., Any], attr: str) -> Callable[..., Any]:
    """``original`` then ``bind_request(req)`` on the handle it made: ``req.<attr>`` (the sender),
    or the returned DecodeRequest's ``kv_receiver``. Only kvbridge's handles have ``bind_request``."""

    @functools.wraps(original)
    def wrapper(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, req, *args, **kwargs)
        handle = getattr(req, attr, None) if attr else getattr(result, "kv_receiver", None)
        bind = getattr(handle, "bind_request", None)
        if bind is not None and (not attr or result):
            bind(req)
        return result

    setattr(wrapper, _MARK, True)
    return wrapper


def _point_http_workers_at_kvbridge() -> None:
    """Patch 4 (module docstring). The environment is the one channel to the HTTP server's
    worker processes, which SGLang starts after this process loaded its plugins."""
    current = os.environ.get(APP_PATH_ENV, "")
    if current in ("", SGLANG_APP_PATH):
        os.environ[APP_PATH_ENV] = APP_PATH
    elif current != APP_PATH:
        logger.warning("%s=%s: with --tokenizer-worker-num > 1 that app's worker processes must call "
                       "kvbridge.integrations.sglang.install() before SGLang builds its TokenizerWorker, or "
                       "TransferBackend('kvbridge') fails there (kvbridge's app %s does it)", APP_PATH_ENV, current,
                       APP_PATH)
