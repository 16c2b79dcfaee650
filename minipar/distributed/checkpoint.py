"""Distributed checkpoints with torch.distributed.checkpoint's names: save on N ranks, load on M.

    from minipar.distributed import checkpoint as dcp
    dcp.save({"trainer": trainer, "step": step, "rng": minipar.get_rng_state()},
             checkpoint_id="ckpt/step-100")
    state = {"trainer": trainer, "step": 0, "rng": None}
    dcp.load(state, checkpoint_id="ckpt/step-100")     # fills ``state`` in place

The state dict's values are trees (``{"model": module.state_dict()}``) or Stateful objects,
anything with ``state_dict()`` and ``load_state_dict()``: a module, an optimizer, ``AppState``,
ZeRO, the 3D trainer. Every rank writes ``shard-<rank>-<save>.npz``, rank 0 then
``manifest.npz``; a load needs no communication, so a checkpoint of N ranks loads in a plain
process started without mpiexec. The layout on disk and how a load reshards: docs/checkpoints.md.
"""
import os
import re
import sys
import uuid

from .. import backend, io
from ..autograd import Tensor
from .sharded import ShardedTensor, assemble, box, decode_index, encode_index, fill, view
from .state import AppState  # noqa: F401  (dcp.AppState)
from .tree import is_array, is_stateful, items, unflatten

MANIFEST, FORMAT, VERSION = "manifest.npz", "minipar-distributed-checkpoint", 1


def shard_name(rank, run):
    # the save's own name: a re-save into the folder writes beside the checkpoint it replaces
    return f"shard-{rank:05d}-{run[:8]}.npz"


SHARD = re.compile(r"shard-\d{5}(-[0-9a-f]{8})?\.npz")  # this save's and older saves' names


def _group(process_group, no_dist=False):
    """The communicator to save over: the one given, else the world when minipar.comm is
    loaded (an MPI program), else None (one process)."""
    if no_dist:
        return None
    if process_group is not None or "minipar.comm" not in sys.modules:
        return process_group
    from .. import comm

    world = comm.world()
    return world if world.size > 1 else None


# ----------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------

def save(state_dict, *, checkpoint_id, process_group=None, no_dist=False):
    """Write this rank's shard and (rank 0) the manifest into the folder ``checkpoint_id``.
    Collective: every rank of ``process_group`` (default: the world when minipar.comm is in use,
    else one process; ``no_dist=True``, torch's old flag: this process alone, e.g. rank 0 saving
    a serial model) calls it; returns once the manifest is on disk."""
    comm = _group(process_group, no_dist)
    rank, size = (comm.rank, comm.size) if comm else (0, 1)
    os.makedirs(checkpoint_id, exist_ok=True)
    arrays, layout = [], []
    for path, leaf in items(state_dict):
        if isinstance(leaf, Tensor):
            leaf = leaf.data
        if isinstance(leaf, ShardedTensor):
            pieces = leaf.pieces if leaf.write else []
            shape, dtype = leaf.shape, leaf.dtype
        elif is_array(leaf):  # the same on every rank (a replicated parameter): rank 0 writes it
            pieces = [(box(leaf.shape), leaf)] if rank == 0 else []
            shape, dtype = tuple(leaf.shape), leaf.dtype
        else:
            layout.append((path, "value", leaf))
            continue
        chunks = []
        for index, array in pieces:
            arrays.append(backend.to_numpy(array))
            chunks.append((rank, len(arrays) - 1, encode_index(index)))
        layout.append((path, "tensor", (shape, str(dtype), chunks)))
    run = comm.broadcast_object(uuid.uuid4().hex) if comm else uuid.uuid4().hex
    mine = os.path.join(checkpoint_id, shard_name(rank, run))
    digest = error = None
    try:  # an error here is every rank's: the manifest waits for all shards
        data = io.to_bytes({"run": run, "rank": rank, "pieces": arrays})
        io.write_atomic(mine, data)
        digest = data[-64:].decode()
    except Exception as e:
        error = f"rank {rank}: {type(e).__name__}: {e}"
    everyone = comm.gather_object((layout, digest, error)) if comm else [(layout, digest, error)]
    if rank == 0:
        error = "; ".join(e for _, _, e in everyone if e)
        try:
            if not error:
                manifest = _manifest(everyone, run)
                # the switch: one atomic rename makes this save the folder's checkpoint; until
                # then the previous one (its manifest and its shards) is whole
                io.save(manifest, os.path.join(checkpoint_id, MANIFEST))
                _remove_stale(checkpoint_id, {name for name, _ in manifest["files"]})
        except Exception as e:
            error = f"rank 0: {type(e).__name__}: {e}"
    error = comm.broadcast_object(error) if comm else error
    if error:
        if digest is not None:  # a failed save leaves only what was there before
            _remove(mine)
        raise RuntimeError(f"saving the checkpoint {checkpoint_id} failed: {error}")


def _remove_stale(folder, keep):
    """Remove the shard files of earlier saves into ``folder``: after the switch, nothing
    names them. And the temporary files of shards and manifests that a killed save left
    (``io.write_atomic``'s): this save's were all renamed before the switch, so any left
    are no live save's; another program's temporary files stay."""
    for name in os.listdir(folder):
        temporary = io.TEMPORARY.fullmatch(name)
        target = temporary["name"] if temporary else ""
        if (SHARD.fullmatch(name) and name not in keep
                or target == MANIFEST or SHARD.fullmatch(target)):
            _remove(os.path.join(folder, name))


def _remove(path):
    try:
        os.unlink(path)
    except OSError:  # a file left behind costs disk space, not correctness
        pass


def _manifest(everyone, run):
    """Merge every rank's layout: one record per path, pieces from all ranks, values per rank."""
    records = {}
    for rank, (layout, _, _) in enumerate(everyone):
        for path, kind, payload in layout:
            record = records.setdefault(path, {"kind": kind, "ranks": {}, "chunks": []})
            if record["kind"] != kind:
                raise ValueError(f"{_name(path)} is a tensor on one rank and a value on another")
            if kind == "value":
                record["ranks"][rank] = payload
                continue
            shape, dtype, chunks = payload
            if record.setdefault("shape", (shape, dtype)) != (shape, dtype):
                raise ValueError(f"{_name(path)}: shape/dtype {record['shape']} on one rank, "
                                 f"{(shape, dtype)} on rank {rank}")
            record["chunks"] += chunks
    return {"format": FORMAT, "version": VERSION, "run": run, "world_size": len(everyone),
            "files": [(shard_name(r, run), digest) for r, (_, digest, _) in enumerate(everyone)],
            "records": [(path, r) for path, r in records.items()]}


def _name(path):
    return "".join(f"[{key!r}]" for _, key in path) or "the state dict"


# ----------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------

def load(state_dict, *, checkpoint_id, process_group=None, no_dist=False):
    """Fill ``state_dict`` in place from the checkpoint in the folder ``checkpoint_id``,
    resharding to this run's layout; ``io.CheckpointError`` naming the file when a file is
    missing, damaged or from another save, ``KeyError`` naming the keys the checkpoint lacks:
    in every case before anything is changed."""
    comm = _group(process_group, no_dist)
    rank, size = (comm.rank, comm.size) if comm else (0, 1)
    manifest, files = read(checkpoint_id)
    # a Python value comes back from the same rank when the world size is unchanged, else from
    # the lowest rank that saved it
    same = manifest["world_size"] == size
    tree = _tree(manifest, files, rank if same else None)
    plan, missing = [], []
    _fill(state_dict, tree, (), plan, missing)
    if missing:
        raise KeyError(f"the checkpoint {checkpoint_id} has no " + ", ".join(missing))
    for apply in plan:
        apply()


def read(checkpoint_id):
    """The manifest and every shard file's pieces, each file checked against the manifest: a
    missing shard, a damaged one or a manifest of another save is an error naming the file, on
    every rank alike, before anything changes."""
    where = os.path.join(checkpoint_id, MANIFEST)
    manifest = io.load(where)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise io.CheckpointError(f"{where} is not a minipar distributed checkpoint manifest")
    files = []
    for rank, (name, digest) in enumerate(manifest["files"]):
        path = os.path.join(checkpoint_id, name)
        if not os.path.exists(path):
            raise io.CheckpointError(f"{path} is missing: the manifest lists "
                                     f"{len(manifest['files'])} shard files")
        shard, actual = io.read(path)
        if actual != digest or shard.get("run") != manifest["run"]:
            raise io.CheckpointError(f"{path} is not the file the manifest {where} names (its "
                                     f"SHA-256 differs): the shards and the manifest come from "
                                     f"different saves")
        # the records find a piece by its rank's place in this list: a file out of its place
        # would give pieces of another rank's (an IndexError, or wrong values)
        if shard.get("rank", rank) != rank:
            raise io.CheckpointError(f"the manifest {where} lists {path} as rank {rank}'s shard "
                                     f"file, but it holds rank {shard['rank']}'s: the "
                                     f"manifest's shard files are out of order")
        files.append(shard["pieces"])
    return manifest, files


class _Global:
    """A global tensor of the checkpoint, assembled from its pieces when first asked for."""

    def __init__(self, path, record, files):
        self.path, self.record, self.files, self._array = path, record, files, None
        self.shape = tuple(record["shape"][0])

    def array(self):
        if self._array is None:
            shape, dtype = self.record["shape"]
            pieces = [(decode_index(index), self.files[rank][entry])
                      for rank, entry, index in self.record["chunks"]]
            self._array = assemble(shape, dtype, pieces, _name(self.path))
        return self._array


def _tree(manifest, files, rank):
    """The checkpoint as one nested tree: tensors as ``_Global``, values picked for ``rank``
    (None: from the lowest rank that saved them)."""
    pairs = []
    for path, record in manifest["records"]:
        if record["kind"] == "tensor":
            pairs.append((path, _Global(path, record, files)))
        else:
            ranks = record["ranks"]
            pairs.append((path, ranks[rank] if rank in ranks else ranks[min(ranks)]))
    return unflatten(pairs)


def materialize(tree):
    """The tree with every ``_Global`` replaced by its NumPy array."""
    if isinstance(tree, _Global):
        return tree.array()
    if isinstance(tree, dict):
        return {k: materialize(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(materialize(v) for v in tree)
    return tree


def _fill(target, source, path, plan, missing):
    """Plan the in-place loading of ``target`` (a dict or a list) from ``source``."""
    keys = list(target) if isinstance(target, dict) else range(len(target))
    for key in keys:
        here = path + (key,)
        if not _has(source, key):
            missing.append("".join(f"[{k!r}]" for k in here))
            continue
        mine, theirs = target[key], source[key]
        if is_stateful(mine):
            # a dry run over what it holds now: a shape that differs, here or in any other
            # object of the state dict, is named before anything loads
            unfound = []
            _fill(mine.state_dict(), theirs, here, [], unfound)
            if hasattr(mine, "named_parameters"):  # a module loads strictly: every key
                missing += unfound
            value = materialize(theirs)
            plan.append(lambda m=mine, v=value: m.load_state_dict(v))
        elif isinstance(mine, (dict, list)):
            _fill(mine, theirs, here, plan, missing)
        elif isinstance(mine, (ShardedTensor, Tensor)) or is_array(mine):
            plan.extend(_copies(mine, theirs, here))
        else:
            plan.append(lambda t=target, k=key, v=materialize(theirs): t.__setitem__(k, v))


def _has(source, key):
    if isinstance(source, dict):
        return key in source
    return isinstance(source, (list, tuple)) and isinstance(key, int) and key < len(source)


def _copies(mine, theirs, path):
    """Closures that copy the checkpoint's tensor into ``mine`` (its pieces for a sharded one)."""
    name = "".join(f"[{k!r}]" for k in path)
    if not isinstance(theirs, _Global):
        raise TypeError(f"{name} is a tensor here but a {type(theirs).__name__} in the checkpoint")
    pieces = mine.pieces if isinstance(mine, ShardedTensor) else [
        (box(mine.shape), mine.data if isinstance(mine, Tensor) else mine)]
    if tuple(mine.shape) != theirs.shape:
        raise ValueError(f"{name} has shape {tuple(mine.shape)} here and {theirs.shape} in the "
                         f"checkpoint")
    # a rank reads whole tensors to take a slice: simple, and cheap at this scale (torch's
    # planner reads only the overlapping pieces)
    full = theirs.array()
    return [lambda i=i, a=a: fill(a, view(full, i)) for i, a in pieces]
