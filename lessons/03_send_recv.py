"""Lesson 3: point-to-point messages: ping-pong latency and bandwidth, a deadlock and two ways out.

    mpiexec -n 2 python lessons/03_send_recv.py
    MINIPAR_SYNC_SENDS=1 mpiexec -n 2 python lessons/03_send_recv.py   # every send synchronous

Everything later (collectives, data parallel, pipelines) is built from send and recv. A message
of n bytes costs about alpha + n * beta: alpha is the latency (software, handshake), 1/beta the
bandwidth. A ping-pong measures both: rank 0 sends, rank 1 sends it back; half the round trip is
one message. Then a deadlock: both ranks send a large message first and receive second. A large
send waits until the receiver posts its receive (rendezvous), so both wait for ever. Two ways
out: ``sendrecv`` (send and receive as one call) or non-blocking ``isend`` + ``recv`` + ``wait``.

Read next: minipar/comm/communicator.py, wire.py, then watch.py; proved by
tests/test_comm_p2p.py.
"""
import time

from minipar import backend
from minipar.comm import fit, wire

from _kit import arguments, check, finish, mpi_world, say

args = arguments(__doc__, quick="three message sizes, fewer round trips")
world = mpi_world(__doc__, ranks=(2,))
rank, peer = world.rank, 1 - world.rank
xp = backend.xp()  # the messages live where training would put them: NumPy, or CuPy on a GPU


def ping_pong(nbytes, iters):
    """Seconds for one message of n bytes: half the median round trip."""
    buf = xp.zeros(nbytes, xp.uint8)

    def round_trip():
        if rank == 0:
            world.send(buf, 1)
            world.recv(buf, 1)
        else:
            world.recv(buf, 0)
            world.send(buf, 0)
    return fit.timed(world, round_trip, iters) / 2


say("1. Ping-pong: one message of n bytes takes alpha + n*beta",
    f"{'bytes':>10s} {'time_us':>9s} {'GB/s':>7s}")
for nbytes in [8, 64 << 10, 1 << 20] if args.quick else [8, 1024, 64 << 10, 1 << 20, 8 << 20]:
    t = ping_pong(nbytes, (5 if args.quick else 30) if nbytes < (1 << 20) else 8)
    say(f"{nbytes:10d} {t * 1e6:9.1f} {nbytes / t / 1e9:7.2f}")
world.counters.reset()

# 2. The deadlock. A blocking send of a large message returns only once the receiver has posted
# its receive. We start the send non-blocking and give it a second, as a blocking send would be.
big = xp.ones(8 << 20, xp.uint8)
got = xp.empty_like(big)
request = world.isend(big, peer)
deadline = time.perf_counter() + 1.0
while not request.test() and time.perf_counter() < deadline:
    time.sleep(0.01)
stuck = not request.done
say("\n2. Both ranks: send(8 MiB) then recv.",
    "   after 1 s the send has " + ("NOT completed: each rank waits for the other to "
    "receive. With a blocking send this is a deadlock." if stuck else
    "completed (this MPI buffered it eagerly; with larger messages it would not)."))
world.recv(got, peer)  # way out 1: post the receive while the send is in flight, then wait
request.wait()
arrived = bool((got == 1).all())
say("   way out 1: isend, then recv, then wait  -> completed")

got[:] = 0
world.sendrecv(big, peer, got, peer)  # way out 2: one call that sends and receives together
arrived &= bool((got == 1).all())
counted = world.counters.snapshot()
say("   way out 2: sendrecv                     -> completed",
    f"\n3. Counters of rank 0 for part 2: {counted}")

# 4. Why the bug hides: MPI sends a small message eagerly (buffered, the send returns before the
# receive is posted), so send-then-recv on both ranks passes at 8 bytes and deadlocks at 8 MiB.
# MINIPAR_SYNC_SENDS=1 makes every send MPI's synchronous one (MPI_Ssend), which returns only
# once its receive is posted: the bug deadlocks at every size (the assignment checks use it).
small, eager = xp.ones(8, xp.uint8), None
if rank == 0:
    request = world.isend(small, 1)
    deadline = time.perf_counter() + 0.3
    while not request.test() and time.perf_counter() < deadline:
        time.sleep(0.01)
    eager = request.done  # seen before rank 1 posts its receive: it waits at the barrier first
world.barrier()
if rank == 1:
    world.recv(xp.empty_like(small), 0)
else:
    request.wait()
if eager:
    seen = ("it completed (sent eagerly): here the deadlock of part 2 hides.\n"
            "   MINIPAR_SYNC_SENDS=1 makes each send synchronous (MPI_Ssend): it shows at any size")
elif wire.SYNC_SENDS:
    seen = ("it waits: MINIPAR_SYNC_SENDS=1 made every send synchronous (MPI_Ssend),\n   "
            "so the deadlock of part 2 happens at every size")
else:
    seen = "it waits (this MPI sends no message eagerly)"
say("\n4. An 8-byte send whose receive is not posted yet: " + seen)
if wire.SYNC_SENDS:
    check("with synchronous sends an 8-byte send waits for its receive", not eager,
          "not completed before the receive", "completed")
check("both ways out delivered the 8 MiB intact", arrived, "every byte 1", "a byte not 1")
check("the counters saw exactly two 8 MiB messages each way", counted["bytes_sent"] ==
      counted["bytes_received"] == 2 * big.nbytes, f"{2 * big.nbytes} B sent and received",
      f"{counted['bytes_sent']} B sent, {counted['bytes_received']} B received")
raise SystemExit(finish("the deadlock's two ways out work and move exactly what they should"))
