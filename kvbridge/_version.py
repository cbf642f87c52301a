"""Versions, in one place: the package's, and the control-channel wire protocol's
(which is also a field of the runtime contract)."""

__version__ = "0.1.0"
WIRE_VERSION = 18  # 2: TransferRequest names the decode rank's registration instead of its buffer table;
# 3: the aux row is reported in the PagesDone of the write that carried it (no AuxDone);
# 4: messages travel as length-prefixed frames on plain TCP connections (3 travelled over ZMQ)
# 5: typed msgspec structs in a binary envelope (version, optional HMAC); a connection opens with a Hello
# 6: Abort and Ping name the decode registration; Challenge / ChallengeEcho prove a connection holds
# the memory its registration describes (a nonce written into its scratch region)
# 7: staged transfers: TransferRequest describes the decode staging area; SlotRequest, SlotGrant, ChunkLanded
# 8: the decode staging area is in the rank's registration; prefill refuses a request whose area differs
# (a 7 decode registers none, so its staged requests would be refused: the contract tells them apart first)
# 9: a connection opens with the server's HelloChallenge; the Hello carries its nonce under the MAC
# (a captured Hello opens no other connection)
# 10: KeyChallenge / KeyProof: a connection proves it is the registration its Hello names with the proof
# key in that registration, before the scratch nonce is written (issue 26: reading the nonce is not enough)
# 11: proof by read: a Challenge with a nonce asks the rank to write its key's signature into its own scratch
# region, which prefill reads back; nothing is written into memory before it is proven (issue 32)
# 12: RoomTicket: a room's decider (CP, TP rank 0, stage 0 of the DP group) signs who holds it; the decode rank
# hands it to the other ranks it asked (its TP rank 0: to every rank of its instance's TP columns), which serve only
# the instance it names (issue 32: one decision per room); TransferRequest.kind_units and
# PagesDone.kind_units/kind_last carry window, compressed and state pools (issue 30); Release: decode needs nothing of a room, which ends
# at once (issue 31)
# 13: PagesDone.kind_digests: per window, compressed or state pool, a digest per unit it reports (issue 30: page
# digests cover the kind pools too)
# 14: TransferRequest.aux_inline / PagesDone.aux_row: the aux row carried in the report instead of written into
# decode's aux rows (decode writes it into its slot at the commit; issue 33: one write fewer after a room's last
# layer)
# 15: TransferRequest.aux_ahead: a decode rank whose aux rows are device memory asks for the row in a report of its
# own, sent right after the pages' write is posted, and writes it into its slot while they land (issue 33: the
# host -> device copy off the commit)
# 16: SlotRequest carries the chunk's scatter list (ChunkLanded none): decode checks it when the request comes, so
# neither prefill's report of a final write nor decode's landing builds, sends or checks it (issue 33: the slot's
# cycle)
# 17: a secret's frames are sealed with keyed BLAKE3 under a key derived per channel (envelope kind 2) instead of
# HMAC-SHA256 (kind 1, refused by name): a third of the MAC's time on a staged chunk's SlotRequest (issue 33)
# 18: TransferRequest.staging_granted: decode slots granted with the request to the recipient's first chunks of the
# room, which write into them without waiting for a SlotGrant (their SlotRequests still carry the scatter lists,
# checked before anything is scattered); a 17 prefill would ignore the field and wait for grants never sent
# (issue 33: the grant's round trip off a room's first chunk)
