"""Ranks agree on every collective call, or they hear about it: fingerprints in the message tag.

    kind = agreement.fingerprint("all_reduce", 2, "sum", dtype, count, root=None)  # 2: ring's
    tag = kind | (call & CALL_MASK) << CALL_SHIFT      # what wire.Wire.call sets
    agreement.describe(tag)         # 'all_reduce #3 (ring, sum, float32)'
    agreement.difference(a, b)      # 'collectives differ across ranks', ...

Every collective call's number and fingerprint (collective, algorithm, op, dtype, a hash of
count and root) ride in the tag of every message it sends anyway, so checking costs no extra
message; a receive that gets another call's tag raises a CommError naming both calls
(docs/comm.md). An algorithm that sends none (shm.py) meets in ``exchange``: empty messages
whose tag is the fingerprint. ``check=False`` or ``MINIPAR_CHECK=0`` leaves only the dtype.

    bits, low to high:  dtype 5 | collective 4 | algorithm 4 | op 3 | count and root 6 | call rest
"""
import functools
import os
import zlib

from mpi4py import MPI

from minipar.comm import watch
from minipar.comm.errors import CommError, dtype_tag, tag_dtype
from minipar.comm.registry import ALGORITHMS, COLLECTIVES, OPS

ENABLED = os.environ.get("MINIPAR_CHECK", "1") not in ("", "0")
FIELDS = (("dtype", 5), ("collective", 4), ("algorithm", 4), ("op", 3), ("shape", 6))
_TAG_BITS = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB).bit_length()
CALL_SHIFT = sum(bits for _, bits in FIELDS)
CALL_MASK = (1 << max(_TAG_BITS - CALL_SHIFT, 0)) - 1
_KIND = 0xFF << FIELDS[0][1]  # the bits of the collective and the algorithm (4 + 4)


# a call's fingerprint is the same for every call of one shape: worked out once, then a lookup
@functools.lru_cache(maxsize=1024)
def fingerprint(collective, algorithm, op, dtype, count, root):
    """The tag of every message of a call, less its number: ``algorithm`` is the registry's
    number of the algorithm (``ALGORITHMS[collective][name].id``)."""
    values = {"dtype": dtype_tag(dtype), "collective": 1 + COLLECTIVES.index(collective),
              "algorithm": algorithm, "op": 1 + OPS.index(op) if op else 0,
              "shape": zlib.crc32(f"{count},{root}".encode()) % 64}
    tag, shift = 0, 0
    for name, bits in FIELDS:
        tag |= values[name] << shift
        shift += bits
    return tag


def decode(tag):
    """{field: value} of a fingerprinted tag (names where a name is known)."""
    fields, shift = {}, 0
    for name, bits in FIELDS:
        fields[name] = tag >> shift & ((1 << bits) - 1)
        shift += bits
    fields["call"] = tag >> shift
    collective = COLLECTIVES[fields["collective"] - 1] if fields["collective"] else None
    fields["collective"] = collective
    if collective:
        names = {fn.id: name for name, fn in ALGORITHMS[collective].items()}
        fields["algorithm"] = names.get(fields["algorithm"], "?")
    fields["op"] = OPS[fields["op"] - 1] if 0 < fields["op"] <= len(OPS) else None
    fields["dtype"] = tag_dtype(fields["dtype"])
    return fields


def fingerprinted(tag):
    return tag >= 1 << FIELDS[0][1]


def describe(tag):
    """``all_reduce #3 (ring, sum, float32)`` for a tag (the call number modulo its bits)."""
    f = decode(tag)
    if f["collective"] is None:
        return f"a message of {f['dtype']} data (no fingerprint: checking is off)"
    what = ", ".join(x for x in (f["algorithm"], f["op"], f["dtype"]) if x)
    return f"{f['collective']} #{f['call']} ({what})"


def difference(mine, theirs):
    """Why two tags differ, in words."""
    a, b = decode(mine), decode(theirs)
    if a["collective"] is None or b["collective"] is None:
        return ("checking differs across ranks: check=False or MINIPAR_CHECK=0 on one side only")
    if a["call"] != b["call"]:
        return (f"collective call numbers differ across ranks (#{a['call']} here, #{b['call']} "
                f"there): a rank skipped a collective call, or made one the others did not")
    for field, words in (("collective", "collectives"), ("algorithm", "algorithms"),
                         ("op", "reduction ops"), ("dtype", "dtypes"),
                         ("shape", "counts or roots")):
        if a[field] != b[field]:
            return f"{words} differ across ranks"
    return "tags differ across ranks"


def disagreement(tags, ranks):
    """Why the tags of one call (one per rank, of world ranks ``ranks``) differ, in the same
    words on every rank that holds them all; None when they agree."""
    bad = next((j for j, tag in enumerate(tags) if tag != tags[0]), None)
    if bad is None:
        return None
    return (f"{describe(tags[0])} on rank {ranks[0]}, {describe(tags[bad])} on rank "
            f"{ranks[bad]}: {difference(tags[0], tags[bad])}")


_EMPTY = [bytearray(), MPI.BYTE]  # an exchange's message: its tag is all it says


def exchange(c):
    """A rendezvous of the ranks of Wire ``c`` (a communicator's collectives' channel) under
    the call's fingerprint ``c.tag``, for an algorithm that sends no message of its own (shm.py,
    hierarchical.py, whose barriers are MPI's, where a peer inside another collective never
    comes): each rank sends the tag to every peer in an empty message and waits for theirs. A
    peer inside another collective gets one (its receive checks the tag) or sends one here: a
    CommError at once on that rank or on this one, and the abort hook ends the job. Peers in
    the same algorithm pass whatever else differs: the caller compares the calls in the same
    words everywhere (shm.header_error)."""
    tag = c.tag
    peers = [j for j in range(c.size) if j != c.rank]
    # one receive per peer, posted before any send: MPICH's network module (MPIR_CVAR_NOLOCAL)
    # can leave empty messages unmatched by receives from any source posted after them
    recvs = [c.mpi.Irecv(_EMPTY, j, MPI.ANY_TAG) for j in peers]
    sends = [c.mpi.Isend(_EMPTY, j, tag) for j in peers]
    status = c.status
    # noted for the watchdog, uncounted: the exchange is the check, not the algorithm's traffic
    with watch.blocking("fingerprint exchange", c.world_ranks):
        for _ in peers:
            try:
                MPI.Request.Waitany(recvs, status)
                got = status.Get_tag()
                foreign = (got ^ tag) & _KIND
            except MPI.Exception as error:  # a message with data: another call's
                if error.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                got, foreign = status.Get_tag(), True
            if foreign:
                raise CommError(f"rank {c.rank}: {describe(tag)} received a message of rank "
                                f"{status.Get_source()}'s {describe(got)}: "
                                f"{difference(tag, got)}")
        MPI.Request.Waitall(sends)


def same_everywhere(comm, what, value, describe=None, error=CommError):
    """Every rank's ``value`` (one all_gather_object, a list in rank order), or, unless every
    rank of Communicator ``comm`` passed an equal one (or one printed alike), the same ``error``
    on every rank: ``what``, then ``describe(everyone)`` in words (default: the settings of a
    dict that differ, rank by rank). The one check of its kind: for what decides which
    messages a rank sends (ranks that differ would post messages that never pair up, or each
    finish with a wrong answer), compared before any of them."""
    everyone = comm.all_gather_object(value)
    # equal, or printed alike (a NaN setting is not equal to itself)
    if any(v != everyone[0] and repr(v) != repr(everyone[0]) for v in everyone):
        raise error(f"{what}: {(describe or settings_differ)(everyone)}")
    return everyone


def settings_differ(everyone):
    """'the ranks disagree on top_k (rank 0: 2, rank 1: 1)' for one dict of settings a rank."""
    differ = [name for name in everyone[0] if len({repr(s.get(name)) for s in everyone}) > 1]
    return "the ranks disagree on " + "; ".join(
        f"{name} (" + ", ".join(f"rank {r}: {s.get(name)!r}" for r, s in enumerate(everyone))
        + ")" for name in differ)
