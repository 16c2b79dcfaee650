"""Pipeline schedules as data: for every rank, the ordered list of actions it runs in one step.

A model cut into S = p*v stages runs on p ranks; stage s lives on rank ``s % p`` as its chunk
``s // p`` (v = 1 except for interleaved 1F1B, where Megatron deals the stages round robin). An
``Action`` names its kind, its stage (the one on *this* rank it computes or serves), the chunk, the
micro-batch and, for messages, the peer rank. One step of 1F1B on 2 ranks with 2 micro-batches:

    rank 0: F(0,0) SEND_F(0,0)->1 F(0,1) SEND_F(0,1)->1 RECV_B(0,0)<-1 B(0,0) RECV_B(0,1)<-1 B(0,1) OPT_STEP
    rank 1: RECV_F(1,0)<-0 F(1,0) B(1,0) SEND_B(1,0)->0 RECV_F(1,1)<-0 F(1,1) B(1,1) SEND_B(1,1)->0 OPT_STEP

Every builder only decides the *order of computation* on each rank (the lecture's picture); one
function, ``_add_messages``, then puts a receive before each computation that needs a remote input
and a send after each one whose output another rank needs.

Contract with a runtime (the same one the simulator and the validator assume):
  - run each rank's list in order; a RECV waits until its data has arrived, a SEND is posted
    without waiting (``isend``; complete them all before OPT_STEP, or earlier), so the only waits
    are receives, and ``validate`` proves they never wait on each other in a cycle;
  - ``message_tag(action, n_stages)`` gives the same MPI tag to a send and its receive;
  - F(s, k) takes its input from RECV_F(s, k) (or from the local F(s-1, k), or the data for s = 0);
    B(s, k) takes its output gradient from RECV_B(s, k) (or local B(s+1, k), or the loss at the
    last stage); W(s, k) needs B(s, k); R(s, k) re-computes F(s, k) from its saved input just before
    B(s, k); OPT_STEP applies the accumulated gradients (PipeDream: the gradient of micro-batch mb);
  - ``Action.version`` (PipeDream only) is the weight version an F or B must use (B uses the
    version stashed by its F) and, on OPT_STEP, the version the update produces.

Cost convention used by ``unit_cost`` and the bubble formulas: per stage F = 1 and a full B = 2
(= an input-gradient B of 1 plus a weight-gradient W of 1); zero-bubble schedules split them into
B = 1 and W = 1; a chunk of an interleaved rank costs 1/v of that; messages and OPT_STEP are free.
"""
from dataclasses import dataclass, replace

F, B, W, R = "F", "B", "W", "R"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
OPT_STEP = "OPT_STEP"
COMPUTE = (F, B, W, R)
SENDS, RECVS = (SEND_F, SEND_B), (RECV_F, RECV_B)


class ScheduleError(ValueError):
    """A schedule that would compute wrong numbers or hang: raised before anything runs."""


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int = -1      # the stage on this rank it computes or serves; -1 for a sync OPT_STEP
    mb: int = -1         # micro-batch; -1 for a sync OPT_STEP
    chunk: int = 0       # stage // p: which of this rank's model chunks
    peer: int = None     # the other rank of a SEND/RECV
    version: int = None  # PipeDream weight version (see the module docstring)

    def __str__(self):
        if self.kind == OPT_STEP:
            return OPT_STEP if self.version is None else f"OPT_STEP(v{self.version})"
        arrow = {SEND_F: "->", SEND_B: "->", RECV_F: "<-", RECV_B: "<-"}.get(self.kind)
        to = f"{arrow}{self.peer}" if arrow and self.peer is not None else ""
        return f"{self.kind}(stage {self.stage}, mb {self.mb}){to}"


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

    @property
    def n_stages(self):
        return self.ranks * self.chunks

    def rank_of(self, stage):
        return stage % self.ranks

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


# --- the builders: each returns, per rank, the order of (kind, stage, mb) computations -----------

def _check(p, m, v=1):
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need at least 1 stage, 1 micro-batch and 1 chunk (got p={p}, m={m}, v={v})")


def naive(p, m=1):
    """Naive model parallelism: each micro-batch runs through all stages and back before the next
    starts, so one rank works at a time. Utilisation 1/p, bubble (p-1)/p."""
    _check(p, m)
    order = [[(kind, r, k) for k in range(m) for kind in (F, B)] for r in range(p)]
    return _assemble("naive", p, m, 1, order)


def gpipe(p, m, remat=False):
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards; bubble (p-1)/(m+p-1),
    and every stage holds m micro-batches of activations at the peak. With ``remat`` a forward
    keeps only its input and each backward first re-computes it (R): peak one micro-batch."""
    _check(p, m)
    backward = (R, B) if remat else (B,)
    order = [[(F, r, k) for k in range(m)] + [(kind, r, k) for k in range(m) for kind in backward]
             for r in range(p)]
    return _assemble("gpipe", p, m, 1, order, remat=remat)


def _one_f_one_b(p, m, r):
    """Rank r's 1F1B order of (F or B, mb): p-1-r warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards. At most p-r micro-batches are ever live."""
    ### BEGIN SOLUTION one-f-one-b
    warm = min(p - 1 - r, m)
    steady = [pair for k in range(m - warm) for pair in ((F, warm + k), (B, k))]
    return [(F, k) for k in range(warm)] + steady + [(B, k) for k in range(m - warm, m)]
    ### END SOLUTION


def one_f_one_b(p, m):
    """1F1B, PipeDream-Flush (Narayanan et al. 2021): the same bubble as GPipe, (p-1)/(m+p-1), but
    a backward starts as soon as it can, so rank r holds at most p-r micro-batches, not m."""
    _check(p, m)
    order = [[(kind, r, k) for kind, k in _one_f_one_b(p, m, r)] for r in range(p)]
    return _assemble("1f1b", p, m, 1, order)


def interleaved(p, m, v=2):
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each rank holds v chunks (stages
    r, r+p, ...), each 1/v of the work, so the fill and drain shrink v times: bubble
    (p-1)/(v*m + p-1). Micro-batches go in groups of p through chunk 0, then chunk 1, ...; so
    Megatron needs m to be a multiple of p."""
    _check(p, m, v)
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches in groups of p: m={m} must be a "
                         f"multiple of p={p} (try m={p * max(1, round(m / p))})")
    total = m * v

    def step(kind, i, r):  # rank r's i-th forward (or backward): groups of p micro-batches per chunk
        chunk = (i // p) % v
        chunk = v - 1 - chunk if kind == B else chunk  # backwards walk the chunks in reverse
        return kind, chunk * p + r, (i // (p * v)) * p + i % p

    order = []
    for r in range(p):
        warm = min((p - 1 - r) * 2 + (v - 1) * p, total)
        seq = [(F, i) for i in range(warm)]
        seq += [pair for i in range(total - warm) for pair in ((F, warm + i), (B, i))]
        seq += [(B, i) for i in range(total - warm, total)]
        order.append([step(kind, i, r) for kind, i in seq])
    return _assemble("interleaved", p, m, v, order)


def zb_h1(p, m):
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): split the backward into B (the
    input gradient, on the critical path) and W (the weight gradient, which nothing waits for).
    1F1B's order of F and B, with rank r running its W's r micro-batches late, so they fill the
    drain: bubble (p-1)(T_F+T_B-T_W), i.e. (p-1)/(3m+p-1) with F = B = W, a third of 1F1B's, at
    1F1B's activation memory (p-r live micro-batches on rank r)."""
    _check(p, m)
    order = []
    for r in range(p):
        seq, done_b = [], 0
        for kind, k in _one_f_one_b(p, m, r):
            seq.append((kind, r, k))
            if kind == B:
                done_b += 1
                if done_b > r:
                    seq.append((W, r, done_b - 1 - r))
        seq += [(W, r, k) for k in range(max(0, m - r), m)]
        order.append(seq)
    return _assemble("zb-h1", p, m, 1, order, split_backward=True)


def pipedream(p, m):
    """PipeDream's asynchronous 1F1B (Narayanan et al. 2019): no flush; each stage updates its
    weights after every backward. Weight stashing: a micro-batch's backward uses the weights its
    forward used, so on rank r micro-batch k runs on version max(0, k-(p-1-r)) -- p-1-r updates
    behind rank p-1. Over m micro-batches the fill and drain cost (p-1)/(m+p-1); in the steady
    state there is no bubble."""
    _check(p, m)
    order = [[(kind, r, k) for kind, k in _one_f_one_b(p, m, r)] for r in range(p)]
    return _assemble("pipedream", p, m, 1, order, asynchronous=True)


BUILDERS = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
            "zb-h1": zb_h1, "pipedream": pipedream}


def build(name, p, m, v=None, remat=False):
    """The schedule ``name`` (a key of BUILDERS) for p ranks and m micro-batches."""
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(BUILDERS)}")
    if name == "interleaved":
        return interleaved(p, m, 2 if v is None else v)
    if v not in (None, 1):
        raise ValueError(f"only the interleaved schedule takes chunks (got v={v} for {name})")
    if remat and name != "gpipe":
        raise ValueError("re-materialisation is an option of the gpipe schedule")
    return gpipe(p, m, remat) if name == "gpipe" else BUILDERS[name](p, m)


# --- from an order of computations to actions with messages --------------------------------------

def _add_messages(p, n_stages, order):
    """Put RECV before a computation whose input lives on another rank, SEND after one whose
    output another rank needs; F flows to stage s+1, B's input gradient flows to stage s-1."""
    actions = []
    for r, seq in enumerate(order):
        acts = []
        for kind, stage, mb in seq:
            chunk = stage // p
            here = Action(kind, stage, mb, chunk)
            prev, nxt = stage - 1, stage + 1
            if kind == F and prev >= 0 and prev % p != r:
                acts.append(Action(RECV_F, stage, mb, chunk, peer=prev % p))
            if kind == B and nxt < n_stages and nxt % p != r:
                acts.append(Action(RECV_B, stage, mb, chunk, peer=nxt % p))
            acts.append(here)
            if kind == F and nxt < n_stages and nxt % p != r:
                acts.append(Action(SEND_F, stage, mb, chunk, peer=nxt % p))
            if kind == B and prev >= 0 and prev % p != r:
                acts.append(Action(SEND_B, stage, mb, chunk, peer=prev % p))
        actions.append(acts)
    return actions


def _add_versions(actions):
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


def _assemble(name, p, m, v, order, **flags):
    actions = _add_messages(p, p * v, order)
    if flags.get("asynchronous"):
        actions = _add_versions(actions)
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
