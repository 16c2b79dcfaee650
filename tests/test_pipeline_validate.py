"""The validator rejects broken schedules, naming the action at fault, before anything runs."""
import pytest

from minipar.parallel.pipeline import ScheduleError, build, simulate, validate
from minipar.parallel.pipeline.actions import RECV_B, RECV_F, SEND_F, Action


def drop(schedule, rank, kind, stage, mb):
    acts = schedule.actions[rank]
    acts.remove(next(a for a in acts if (a.kind, a.stage, a.mb) == (kind, stage, mb)))
    return schedule


def test_missing_receive_names_the_unmatched_send():
    s = drop(build("1f1b", 2, 3), 1, RECV_F, 1, 2)
    with pytest.raises(ScheduleError) as err:
        validate(s)
    msg = str(err.value)
    assert "rank 0: SEND_F(stage 0, mb 2)->1 has no matching RECV_F(stage 1, mb 2)<-0 on rank 1" in msg
    assert "rank 1: F(stage 1, mb 2) runs before RECV_F(stage 1, mb 2)" in msg


def test_missing_send_names_the_unmatched_receive():
    s = drop(build("gpipe", 3, 2), 2, "SEND_B", 2, 1)
    with pytest.raises(ScheduleError, match=r"rank 1: RECV_B\(stage 1, mb 1\)<-2 has no matching "
                                            r"SEND_B\(stage 2, mb 1\)->1 on rank 2"):
        validate(s)


def test_wrong_peer_and_missing_work_are_named():
    s = build("1f1b", 3, 3)
    acts = s.actions[0]
    i = next(i for i, a in enumerate(acts) if a.kind == SEND_F)
    acts[i] = Action(SEND_F, 0, acts[i].mb, peer=2)
    drop(s, 2, "B", 2, 0)
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert "should run on rank 0 with peer 1" in str(err.value)
    assert "B(stage 2, mb 0) appears 0 times" in str(err.value)


def test_cyclic_wait_is_a_deadlock_naming_ranks_and_actions():
    # rank 0 waits for the gradient of mb 0 before sending mb 1 forward; GPipe's rank 1 wants mb 1
    # forward before it sends any gradient: each waits on the other
    s = build("gpipe", 2, 2)
    acts = s.actions[0]
    moved = [a for a in acts if (a.kind, a.mb) in ((RECV_B, 0), ("B", 0))]
    rest = [a for a in acts if a not in moved]
    at = next(i for i, a in enumerate(rest) if (a.kind, a.mb) == ("F", 1))
    s.actions[0] = rest[:at] + moved + rest[at:]
    with pytest.raises(ScheduleError) as err:
        validate(s)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "rank 0 waits at RECV_B(stage 0, mb 0)<-1 for rank 1" in msg
    assert "rank 1 waits at RECV_F(stage 1, mb 1)<-0 for rank 0" in msg
    assert "ranks 0 -> 1 -> 0" in msg


def test_simulator_alone_also_refuses_to_hang():
    s = drop(build("1f1b", 2, 2), 1, "SEND_B", 1, 1)
    with pytest.raises(ScheduleError, match=r"rank 0 waits at RECV_B\(stage 0, mb 1\)<-1 for rank 1; "
                                            "rank 1 finished without sending it"):
        simulate(s)


def test_work_after_the_optimizer_step_is_rejected():
    s = build("gpipe", 1, 2)
    s.actions[0] = s.actions[0][-1:] + s.actions[0][:-1]
    with pytest.raises(ScheduleError, match="runs after the optimizer step"):
        validate(s)
