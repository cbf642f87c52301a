"""``kvbridge chaos --hostile --quick --json`` end to end: the transport attacks (pre-auth flood,
slow connection, slot exhaustion) against real processes (daemon with a write token, CP 2
prefill ranks, a decode rank with poisoned pages, a cluster secret, real Mooncake over
loopback), each asserted defended, and the request-acceptance attacks (aliasing, room
collision, session spellings, a Mooncake-reading attacker); and the report's shape. The attack that today's code does not defend (read
exposure) is asserted in ``test_hostile_pending.py`` (skipped until its fix lands)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from typing import Any

import pytest

from kvbridge.chaos.hostile import ATTACK_METHODS, ATTACKS, QUICK_ATTACKS, HostileSpec, Outcome, format_hostile, run_hostile
from kvbridge.errors import ConfigError
from kvbridge.transfer.engine import mooncake_available

RECORD = {"attack", "outcome", "target", "bytes_written_where_not_allowed", "rss_before_mib", "rss_after_mib",
          "seconds", "details", "error"}
REPORT = {"ok", "engine", "attacks", "defended", "not_applicable", "vulnerable", "errors", "problems", "exit_codes",
          "seconds", "spec"}


@pytest.fixture(scope="module")
def quick() -> dict[str, Any]:
    """One quick run (one cluster) shared by the tests below: the JSON the command prints."""
    if not mooncake_available():
        pytest.skip("needs the Mooncake transfer engine")
    argv = [sys.executable, "-m", "kvbridge.cli.main", "chaos", "--hostile", "--quick", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=480)
    report = json.loads(done.stdout)
    assert done.returncode == (0 if report["ok"] else 1), done.stderr[-3000:]
    return again_under_load(report, argv)


# The attacks whose verdict waits on real rooms (20 s each with --quick) while a flood holds the
# target: a burst of load from a neighbouring suite can miss those deadlines (seen once in CI, both
# at once, each defended alone and under 4 busy loops). Each is run once more, alone, in a fresh
# cluster; a defence that is really broken is vulnerable again, and the first record is printed.
LOAD_SENSITIVE = ("starvation", "address_flood", "metadata_flood")


def again_under_load(report: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    for i, a in enumerate(report["attacks"]):
        if a["attack"] in LOAD_SENSITIVE and a["outcome"] == "vulnerable":
            print(f"first run of {a['attack']} (run again alone): {json.dumps(a)}", file=sys.stderr)
            done = subprocess.run([*argv, "--attacks", a["attack"]], capture_output=True, text=True, timeout=240)
            (report["attacks"][i],) = json.loads(done.stdout)["attacks"]
            report.setdefault("ran_again", []).append(a["attack"])
    again = report.get("ran_again", [])
    if again:
        report["problems"] = [p for p in report["problems"] if p.split(":")[0] not in again] + [
            f"{a['attack']}: {a['outcome']}" for a in report["attacks"]
            if a["attack"] in again and a["outcome"] not in ("defended", "not_applicable")]
        report["ok"] = not report["problems"]
    return report


def attack(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(a for a in report["attacks"] if a["attack"] == name)


def test_quick_report_shape_and_exit(quick: dict[str, Any]) -> None:
    assert REPORT <= set(quick) <= REPORT | {"ran_again"}
    assert [a["attack"] for a in quick["attacks"]] == list(QUICK_ATTACKS)
    for a in quick["attacks"]:
        assert set(a) == RECORD, a
        assert a["outcome"] in ("defended", "vulnerable", "error"), a  # (not_applicable: another engine's)
        assert a["rss_before_mib"] is not None and a["rss_after_mib"] is not None, a
    assert set(quick["exit_codes"].values()) <= {0}, quick["exit_codes"]  # every process drained and exited
    assert quick["ok"] is True, quick["problems"]


def test_preauth_flood_is_defended(quick: dict[str, Any]) -> None:
    """Connections that never send a Hello, a quarter of them announcing 8 MiB frames and pushing
    4 MiB each, from 32 loopback addresses, for 3 s while a real room moves. On the old transport
    every connection buffered a partial frame up to the ~8 MiB frame limit before any MAC and was
    never timed out: the prefill rank's RSS grew by the bytes pushed (~200 MiB here, over the
    64 MiB bound). Now a pending connection reads at most one Hello (4 KiB) and an oversized
    announcement closes it at once."""
    a = attack(quick, "preauth_flood")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["room_during_flood_ok"] is True, d
    assert d["rss_growth_mib"] <= d["rss_bound_mib"], d
    assert d["closed_by_server"] > 0, d  # the server closed them; the attacker did not give up


def test_reads_expose_no_sessions_or_addresses(quick: dict[str, Any]) -> None:
    """An anonymous client reads GET /v1/ranks/{id} and /v1/instances of a daemon that has a write
    token. Before issue 20 both answered 200 with session ids and buffer base addresses (reads were
    open unless a read token was set); now any configured token closes reads to anonymous clients."""
    a = attack(quick, "read_exposure")
    assert a["outcome"] == "defended", json.dumps(a)
    for path, seen in a["details"]["anonymous"].items():
        assert seen["status"] == 401 and not seen["session_ids"] and not seen["buffer_addresses"], (path, seen)


def test_slow_connection_is_defended(quick: dict[str, Any]) -> None:
    """A connection that sends a Hello's frame header, then one byte a second. The old transport
    had no deadline on a partial frame and kept it for as long as it dribbled (the 8 s watch
    ends with closed_after_s None: vulnerable); now it is closed at the Hello deadline (2 s)."""
    a = attack(quick, "slow_connection")
    assert a["outcome"] == "defended", json.dumps(a)
    before = a["details"]["before_hello"]
    assert before["closed_after_s"] is not None, before


def test_slot_exhaustion_is_defended(quick: dict[str, Any]) -> None:
    """4,200 idle unauthenticated connections held against a prefill rank (re-opened as they are
    closed), then the decode rank is restarted and must connect and move a room. On the old
    transport idle connections took authenticated slots: 4,096 filled the cap, every later
    connection was reset, the restarted rank's too, and the room failed. Now unauthenticated
    connections only ever take the small pending pool (newcomers evict the oldest), apart from
    the slots of authenticated peers."""
    a = attack(quick, "slot_exhaustion")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["restarted_decode_room_ok"] is True, d
    assert d["attacker_open_peak"] >= HostileSpec.quick().exhaust_connections, d  # the flood really held the cap


def test_aliasing_writes_nothing_to_the_victim(quick: dict[str, Any]) -> None:
    """A write-token + secret holder registers the victim decode rank's session id, pool bases and
    scratch region as its own, names that registration in its Hello and asks both prefill ranks
    for a room into the victim's free (poisoned) pages. Before issue 20 the registration was
    accepted and 974,848 bytes landed from each prefill rank (8 pages). Now the daemon refuses
    the claim on the victim's session (409 claim_held, naming the victim rank); behind it, each
    prefill rank would write a nonce into the scratch region at the victim's session, which the
    attacker cannot echo (tests/transfer/test_ownership.py drives that second wall alone)."""
    a = attack(quick, "aliasing")
    assert a["outcome"] == "defended", json.dumps(a)
    assert a["bytes_written_where_not_allowed"] == 0, a
    d = a["details"]
    assert d.get("victim_pages_overwritten", 0) == 0, d
    if d["registration_status"] == 409:
        assert "claim_held" in d["refusal"], d
    else:  # a daemon that let the alias through: the ownership proof must stop it
        assert len(d["prefill_refusals"]) == 2, d
        assert all("could not prove it holds the memory it registered" in r for r in d["prefill_refusals"]), d


def test_room_collision_first_claim_wins(quick: dict[str, Any]) -> None:
    """A second decode instance (a real decode worker) asks for a room the legitimate one claimed
    and, every other trial, an Abort for it is sent in the second instance's name. Before, the
    KV was served to both, or the legitimate room failed on the other's abort; now the
    legitimate room succeeds exactly once and the second is refused, naming the holder."""
    a = attack(quick, "room_collision")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["served_twice"] == 0 and d["legit_failed"] == 0, d
    assert a["bytes_written_where_not_allowed"] == 0, a
    assert all("claimed by decode instance" in t["second"] for t in d["trials"]), d


def test_rooms_bound_to_their_request_serve_no_attacker(quick: dict[str, Any]) -> None:
    """Issue 31 through real workers: a second decode instance claims another request's room with
    its own prompt's digest, claims a room before its owner opens it, claims a room already
    received, and claims with a prompt one token longer; it is served in no trial (0 bytes), and
    the owner of the room it tried first is still served."""
    a = attack(quick, "bound_rooms")
    assert a["outcome"] == "defended", json.dumps(a)
    trials = {t["case"]: t for t in a["details"]["trials"]}
    assert set(trials) == {"foreign", "preclaimed", "reused", "longer"} and a["bytes_written_where_not_allowed"] == 0
    assert "bound to another request" in trials["foreign"]["attacker"] and trials["foreign"]["owner"] == "ok", trials
    assert trials["reused"]["owner"] == "ok" and trials["reused"]["attacker"].startswith("failed"), trials
    assert trials["preclaimed"]["attacker"].startswith("failed"), trials


def test_forged_expired_and_moved_room_signatures_are_refused(quick: dict[str, Any]) -> None:
    a = attack(quick, "room_signatures")
    assert a["outcome"] == "defended", json.dumps(a)
    assert a["details"]["refused"] == {"forged": "kvbridge_room_sig", "expired": "kvbridge_room_expires",
                                       "other_room": "kvbridge_room_sig", "moved_expiry": "kvbridge_room_sig",
                                       "other_prompt": "kvbridge_room_sig"}, a


def test_a_replayed_hello_holds_no_slot(quick: dict[str, Any]) -> None:
    """One valid Hello captured off a real connection, replayed on 1,200 connections (4,200 in the
    full run) re-opened as they are closed, while the decode rank is restarted. Before issue 26 a
    Hello carried no nonce: 4,200 replays held all 4,096 slots, never timed out, and the restarted
    decode rank could not connect (its room failed). Now each replay answers another connection's
    challenge and is closed at once; none is open past the Hello deadline."""
    a = attack(quick, "hello_replay")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["slots_held"] == 0 and d["restarted_decode_room_ok"] is True, d
    assert d["closed_by_server"] > 0 and d["connects"] >= HostileSpec.quick().replay_connections, d


def test_partial_frames_after_a_valid_hello_are_bounded(quick: dict[str, Any]) -> None:
    """Connections that pass the challenge (the attacker holds the secret) announce the largest
    frame (8 MiB) and push its body while a room moves. Before issue 26 each buffered up to 8 MiB
    for 10 s (40 connections: +331 MiB on a prefill rank); now they share one 16 MiB budget beyond
    8 KiB each, the rest wait, and the room still succeeds."""
    a = attack(quick, "postauth_partial")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["room_during_flood_ok"] is True and d["rss_growth_mib"] <= d["rss_bound_mib"], d
    assert d["connections"] == HostileSpec.quick().postauth_connections and d["bytes_pushed_mib"] > 64, d


def test_a_mac_failing_flood_is_closed(quick: dict[str, Any]) -> None:
    """Authenticated connections push frames signed with another secret as fast as the socket
    takes them. Before issue 26 such frames never closed a connection (8.8 M empty frames cost a
    prefill rank 7.8 CPU-seconds); now each connection is closed after max_bad_macs (3) frames,
    and a room moves meanwhile."""
    a = attack(quick, "mac_flood")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["room_during_flood_ok"] is True and d["left_open"] == 0, d
    assert d["closed_by_server"] >= HostileSpec.quick().mac_flood_connections, d


def test_no_spelling_of_a_live_session_is_another_claim(quick: dict[str, Any]) -> None:
    """Issue 26: the daemon compared sessions as strings and took 7 of 9 other spellings of a live
    decode rank's session as new ones (``localhost:P``, ``127.1:P``, ``127.0.0.1:0P`` ...); prefill's
    proof nonces then landed in the victim. Now every generated spelling is the victim's claim
    (409 naming it) or malformed (400), none is registered, nothing lands, and a real room
    succeeds afterwards."""
    a = attack(quick, "spellings")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["spellings_tried"] >= 90 and not d["accepted"] and set(d["by_status"]) <= {"409", "400"}, d
    assert d["by_status"]["409"] >= 80, d  # (the spellings the resolver reads as the victim's session)
    assert a["bytes_written_where_not_allowed"] == 0 and d["legit_room_ok"], d


def test_an_attacker_reading_mooncake_memory_cannot_prove_the_victims_registration(quick: dict[str, Any]) -> None:
    """Issue 26: an attacker that reads any Mooncake-registered memory read the ownership nonce out
    of the victim's scratch region and echoed it, and prefill wrote the room into the victim. Now
    the first step is a signature by the victim's proof key, which no registered memory holds:
    both prefill ranks refuse the attacker's, no nonce is written (the victim's scratch read back
    unchanged), no page lands, and the victim's own rank is then served the very room."""
    a = attack(quick, "mooncake_reader")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["key_proofs_sent"] == 2 and d["nonces_echoed"] == 0 and d["mooncake_reads"] >= 2, d
    assert len(d["prefill_refusals"]) == 2 and all("not a signature by the proof key" in r
                                                    for r in d["prefill_refusals"]), d
    assert d["pages_overwritten"] == 0 and d["scratch_bytes_changed"] == 0, d
    assert a["bytes_written_where_not_allowed"] == 0, a
    assert d["room_served_to_the_legitimate_rank"] and d["legit_room_ok"], d


def test_forged_nixl_metadata_is_the_victims_claim(quick: dict[str, Any]) -> None:
    """Issue 32: a renamed copy of a live NIXL rank's metadata got 201 and prefill connected to the
    victim's worker. Now the UCX worker address is the claim: every renamed copy is 409."""
    a = attack(quick, "nixl_metadata")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["statuses"]["victim"] == 201 and not d["forgeries_accepted"], d
    assert [v for k, v in d["statuses"].items() if k != "victim"] == [409, 409, 409], d
    assert a["bytes_written_where_not_allowed"] == 0 and d["legit_room_ok"], d


def test_the_daemon_holds_engine_metadata_within_its_cap(quick: dict[str, Any]) -> None:
    """Issue 32: 512 registrations of 512 Ki characters of metadata added +259 MiB to the daemon,
    with no bound. Now it refuses (429 too_much_metadata) past its --max-metadata-chars total (64 Mi
    by default; the quick run's daemon has 8 Mi, reached after 32 registrations, not 256)."""
    a = attack(quick, "metadata_flood")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["cap_mib"] == 8 and d["accepted"] <= 32, d  # 32 of 256 Ki characters fill the cap
    assert d["statuses"].get("429 too_much_metadata") == 1 and d["metadata_held_mib"] <= d["cap_mib"], d
    assert d["rss_growth_mib"] <= d["rss_bound_mib"] and d["legit_room_ok"], d


def test_a_lapsed_lease_is_not_squatted(quick: dict[str, Any]) -> None:
    """Issue 32: a decode worker stopped past its lease had its exact session registered by a
    token holder (201), and its own re-registration was refused. Now the lapsed claim is its key's:
    every squat is 409 (its own key, the victim's public key, none), and after SIGCONT the victim
    registers again and a real room succeeds."""
    a = attack(quick, "lease_squat")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["victim_lapsed_while_stopped"] and set(d["squat_statuses"].values()) == {409}, d
    assert d["squats_accepted"] == 0 and d["legit_room_ok"], d


def test_one_identitys_flood_starves_no_room_and_no_other_identity(quick: dict[str, Any]) -> None:
    """Issue 32: 40 authenticated connections from one address starved two real rooms until they
    failed at 40 s (the frame budget served in arrival order). Now 40 connections of one identity
    pushing paced 4 MiB frames leave both rooms and a second identity's 1 MiB frame their turn."""
    a = attack(quick, "starvation")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["rooms_ok"] and d["rooms"] == 2 and d["slots_held"] == 40, d
    assert d["second_identity_answered_s"] is not None and d["second_identity_answered_s"] <= d["second_identity_due_s"], d


def test_an_address_flood_displaces_no_registered_rank(quick: dict[str, Any]) -> None:
    """Issue 32: 4,100 connections from 4,100 addresses displaced one of a TP 2 decode host's two
    connections and the rank was refused on reconnect (rooms 0 of 2). Now the flood holds every
    free slot of prefill-cp0 and no more, no proven connection is lost, and the TP 2 host's two
    rooms succeed during the hold."""
    a = attack(quick, "address_flood")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["proven_connections"] >= 3 and d["proven_lost"] == 0 and d["rooms_during_hold_ok"], d
    assert d["slots_held"] + d["connections_before"]["peers"] >= d["slots"] and d["refused_after_hello"] > 0, d
    assert d["connections_after"]["proven"] >= d["proven_connections"], d


def test_messages_held_while_proving_are_capped_in_bytes(quick: dict[str, Any]) -> None:
    """Issue 32: held messages were capped by count (+422 MiB on prefill from 16 connections).
    Now 16 connections naming a registration they cannot prove send 128 MiB of requests: what is
    over the caps is refused by name, and prefill's RSS stays within the held cap plus the readers'
    bound while a real room succeeds."""
    a = attack(quick, "proving_bytes")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["refused_over_cap"] > 0 and d["key_challenges"] == d["connections"], d
    assert d["rss_growth_mib"] <= d["rss_bound_mib"] and d["legit_room_ok"], d


def test_a_restarted_daemon_is_no_race_for_a_stopped_victims_session(quick: dict[str, Any]) -> None:
    """Issue 32: across a daemon restart a token holder registered a victim's exact session
    (201) and the victim's own re-registration was refused. Now the restarted daemon reads its
    claims file back before it answers: every squat raced from before it answered is 409, and the
    victim registers again and is served."""
    a = attack(quick, "restart_race")
    assert a["outcome"] == "defended", json.dumps(a)
    d = a["details"]
    assert d["squats_accepted"] == 0 and d["squat_tries"] > 3, d
    assert {s for by_key in d["squat_statuses"].values() for s in by_key} == {"409"}, d
    assert d["victim_registered_again"] and d["legit_room_ok"] and a["bytes_written_where_not_allowed"] == 0, d


def test_unknown_attack_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="unknown attack"):
        run_hostile(HostileSpec(attacks=("aliasing", "nope")))


def test_record_fields_and_table() -> None:
    """The JSON record of an attack has exactly the documented fields, and the table names each."""
    assert {f.name for f in fields(Outcome)} == RECORD
    assert set(QUICK_ATTACKS) <= set(ATTACKS)
    assert tuple(ATTACK_METHODS) == ATTACKS  # every attack has its method, in the order they run
    out = Outcome("aliasing", "vulnerable", "decode-tp0", 1949696, 334.0, 335.0, 0.5, {}, None)
    report = {"attacks": [vars(out)], "defended": [], "seconds": 1.0, "problems": ["aliasing: vulnerable"]}
    text = format_hostile(report)
    assert "VULNERABLE" in text and "1,949,696" in text and "0/1 attacks defended" in text
