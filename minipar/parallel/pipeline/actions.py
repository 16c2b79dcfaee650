"""What a pipeline schedule is: for every rank, the ordered list of actions it runs in one step.

An ``Action`` names its kind, its stage (the one on *this* rank it computes or serves), the
chunk, the micro-batch and, for messages, the peer rank. One step of 1F1B on 2 ranks with 2
micro-batches (``print(build("1f1b", 2, 2))``, in short):

    rank 0: F(0,0) SEND_F(0,0)->1 F(0,1) SEND_F(0,1)->1 RECV_B(0,0)<-1 B(0,0) RECV_B(0,1)<-1 B(0,1) OPT_STEP
    rank 1: RECV_F(1,0)<-0 F(1,0) B(1,0) SEND_B(1,0)->0 RECV_F(1,1)<-0 F(1,1) B(1,1) SEND_B(1,1)->0 OPT_STEP

A builder (schedules.py, zero_bubble.py) decides only the *order of computation* on each rank
(the lecture's picture); ``assemble`` then puts a receive before each computation that needs a
remote input and a send after each one whose output another rank needs. The contract these lists
keep with the runtime, the simulator and the validator, and the cost convention of the bubble
formulas: docs/pipeline.md.
"""
from dataclasses import dataclass, replace

F, B, W, R = "F", "B", "W", "R"
# DualPipeV (dualpipe.py) mixes split and whole backwards: BW is B and its W in one pass (torch's
# FULL_BACKWARD) in a schedule whose B is otherwise the input gradient only; FB, "F&B", is a
# forward of one micro-batch paired with a backward of another (torch's OVERLAP_F_B): its
# receives come before it, its sends after, and it runs its F, then its B (``Action.parts``).
BW, FB = "BW", "F&B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
OPT_STEP = "OPT_STEP"
COMPUTE = (F, B, W, R, BW, FB)
SENDS, RECVS = (SEND_F, SEND_B), (RECV_F, RECV_B)
PLACEMENTS = ("loop", "v")


class ScheduleError(ValueError):
    """A schedule that would compute wrong numbers or hang: raised before anything runs."""


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int = -1      # the stage on this rank it computes or serves; -1 for a sync OPT_STEP
    mb: int = -1         # micro-batch; -1 for a sync OPT_STEP
    chunk: int = 0       # stage // p: which of this rank's model chunks
    peer: int = None     # the other rank of a SEND/RECV
    # PipeDream only: the weight version an F or B must use (B uses the version stashed by its
    # F) and, on OPT_STEP, the version the update produces
    version: int = None
    pair: tuple = None   # F&B only: (the F, the B or BW) it runs, in that order

    @property
    def parts(self):
        """What runs: an F&B pair's F then its B; any other action, itself."""
        return self.pair if self.kind == FB else (self,)

    def __str__(self):
        if self.kind == FB:
            return f"F&B({self.pair[0]} + {self.pair[1]})"
        if self.kind == OPT_STEP:
            return OPT_STEP if self.version is None else f"OPT_STEP(v{self.version})"
        arrow = {SEND_F: "->", SEND_B: "->", RECV_F: "<-", RECV_B: "<-"}.get(self.kind)
        to = f"{arrow}{self.peer}" if arrow and self.peer is not None else ""
        return f"{self.kind}(stage {self.stage}, mb {self.mb}){to}"


# A model cut into S = p*v stages (a stage is a position in the model) runs on p ranks, v stages
# (chunks) each. Where stage s lives is the schedule's placement:
#   "loop"  stage s on rank s % p as its chunk s // p (v = 1, and Megatron's interleaved 1F1B,
#           which deals the stages round robin: rank r holds r, r+p, ...)
#   "v"     ZB-V's V shape (Qi et al. 2023, section 6; v = 2): rank r holds stages r and 2p-1-r,
#           so the model goes down the ranks and back up, and rank 0 holds the first and the last
def rank_of_stage(stage, p, placement="loop"):
    """The rank that holds ``stage`` of p*v: s % p, or in a V the mirror image on the way back."""
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


@dataclass
class Schedule:
    name: str
    ranks: int                  # p
    microbatches: int           # m
    chunks: int                 # v, model chunks per rank
    actions: list               # actions[rank] = [Action, ...] in execution order
    split_backward: bool = False  # B is the input gradient only; W is separate (zero bubble)
    remat: bool = False           # forwards keep only their input; R re-computes before B
    asynchronous: bool = False    # PipeDream: an OPT_STEP after every backward, no flush
    placement: str = "loop"       # where each stage lives: "loop" or "v" (see rank_of_stage)
    runtime: type = None          # the Pipeline subclass it needs, if any (PipeDream: pipedream.py)

    @property
    def n_stages(self):
        return self.ranks * self.chunks

    def rank_of(self, stage):
        return rank_of_stage(stage, self.ranks, self.placement)

    def stages_of(self, rank):
        """The stages ``rank`` holds, chunk 0 first (chunk = stage // p in both placements)."""
        return [s for s in range(self.n_stages) if self.rank_of(s) == rank]

    def __str__(self):
        return "\n".join(f"rank {r}: " + "  ".join(map(str, acts)) for r, acts in enumerate(self.actions))


def message_key(action):
    """What a message carries, the same for a send and its receive: (F or B, receiving stage, mb)."""
    if action.kind == SEND_F:
        return (F, action.stage + 1, action.mb)
    if action.kind == SEND_B:
        return (B, action.stage - 1, action.mb)
    return ({RECV_F: F, RECV_B: B}[action.kind], action.stage, action.mb)


def message_tag(action, n_stages):
    """An MPI tag unique to one message of one step: ((mb * S + receiving stage) * 2 + direction)."""
    direction, stage, mb = message_key(action)
    return (mb * n_stages + stage) * 2 + (direction == B)


def check_sizes(p, m, v=1):
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need at least 1 stage, 1 micro-batch and 1 chunk (got p={p}, m={m}, v={v})")


# --- from an order of computations to actions with messages --------------------------------------

def add_messages(p, n_stages, order, placement="loop"):
    """Put RECV before a computation whose input lives on another rank, SEND after one whose
    output another rank needs; F flows to stage s+1, B's input gradient flows to stage s-1.
    An F&B step, (FB, (F, stage, mb), (B or BW, stage, mb)), gets the receives of both its
    passes before it and the sends of both after it."""
    actions = []
    for r, seq in enumerate(order):
        acts = []
        for step in seq:
            if step[0] == FB:
                (recv_f, f, send_f), (recv_b, b, send_b) = (_with_messages(r, *half, p, n_stages, placement)
                                                            for half in step[1:])
                acts += recv_f + recv_b + [Action(FB, pair=(f, b))] + send_f + send_b
            else:
                recvs, action, sends = _with_messages(r, *step, p, n_stages, placement)
                acts += recvs + [action] + sends
        actions.append(acts)
    return actions


def _with_messages(r, kind, stage, mb, p, n_stages, placement):
    """(the receives before, the action, the sends after) of one computation on rank r."""
    chunk = stage // p
    prev, nxt = stage - 1, stage + 1
    to_prev = rank_of_stage(prev, p, placement) if prev >= 0 else r
    to_next = rank_of_stage(nxt, p, placement) if nxt < n_stages else r
    recvs, sends = [], []
    if kind == F and to_prev != r:
        recvs.append(Action(RECV_F, stage, mb, chunk, peer=to_prev))
    if kind in (B, BW) and to_next != r:
        recvs.append(Action(RECV_B, stage, mb, chunk, peer=to_next))
    if kind == F and to_next != r:
        sends.append(Action(SEND_F, stage, mb, chunk, peer=to_next))
    if kind in (B, BW) and to_prev != r:
        sends.append(Action(SEND_B, stage, mb, chunk, peer=to_prev))
    return recvs, Action(kind, stage, mb, chunk), sends


def add_versions(actions):
    """PipeDream: an OPT_STEP after each backward; F reads the current version, B the stashed one."""
    out = []
    for acts in actions:
        version, stash, new = 0, {}, []
        for a in acts:
            if a.kind == F:
                stash[(a.stage, a.mb)] = version
                new.append(replace(a, version=version))
            elif a.kind == B:
                new.append(replace(a, version=stash[(a.stage, a.mb)]))
            else:
                new.append(a)
            if a.kind == B:
                version += 1
                new.append(Action(OPT_STEP, a.stage, a.mb, a.chunk, version=version))
        out.append(new)
    return out


def assemble(name, p, m, v, order, **flags):
    """The Schedule of per-rank ``order``s of (kind, stage, mb): messages, then the OPT_STEP(s)."""
    actions = add_messages(p, p * v, order, flags.get("placement", "loop"))
    if flags.get("asynchronous"):
        actions = add_versions(actions)
    else:
        actions = [acts + [Action(OPT_STEP)] for acts in actions]
    return Schedule(name, p, m, v, actions, **flags)


def weight_versions(schedule):
    """PipeDream: {(stage, mb): (version its F used, version its B used)} -- equal under stashing."""
    seen = {}
    for acts in schedule.actions:
        for a in acts:
            if a.kind in (F, B):
                seen.setdefault((a.stage, a.mb), {})[a.kind] = a.version
    return {key: (v[F], v[B]) for key, v in seen.items()}
