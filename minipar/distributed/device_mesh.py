"""torch's DeviceMesh (torch.distributed.device_mesh): the ranks in an n-D array, one process
group per slice along each named dimension, over process_group.py's groups.

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh["dp"].get_group()                 # this rank's data-parallel ProcessGroup
    mesh.size(), mesh["tp"].size(), mesh.get_local_rank("tp")

Ranks are numbered as torch's, ``arange(world).reshape(mesh_shape)``, the last dimension varying
fastest: for (dp, tp), minipar.parallel.groups.RankGrid's tp-dp order (Megatron's), a tensor
group on neighbouring ranks. ``device_type`` ("cpu", "cuda") is recorded: the backend decides.
"""
import math

import numpy as np  # the mesh is host-side integers, whatever the device backend

from . import process_group as pg


def _dim_names(names, ndim):
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim or len(set(names)) != ndim or not all(isinstance(n, str) for n in names):
        raise ValueError(f"mesh_dim_names {names} must be {ndim} distinct strings, one per "
                         f"dimension of the mesh")
    return names


class DeviceMesh:
    """``mesh``: world ranks in an n-D array (each once); every rank builds it alike, which
    makes the groups (collective, as torch's)."""

    def __init__(self, device_type, mesh, *, mesh_dim_names=None, _groups=None):
        self.device_type = str(device_type)
        self.mesh = np.asarray(mesh, dtype=int)
        self.mesh_dim_names = _dim_names(mesh_dim_names, self.mesh.ndim)
        ranks = self.mesh.ravel().tolist()
        if len(set(ranks)) != len(ranks) or not all(0 <= r < pg.get_world_size() for r in ranks):
            raise ValueError(f"DeviceMesh: {self.mesh.tolist()} must hold world ranks "
                             f"0..{pg.get_world_size() - 1}, each at most once")
        here = np.argwhere(self.mesh == pg.get_rank())
        self._coordinate = here[0].tolist() if len(here) else None
        # dimension d: one group per slice along d, made on every rank in the same order
        self._groups = _groups or [self._group_along(d) for d in range(self.mesh.ndim)]

    def _group_along(self, d):
        rows = np.moveaxis(self.mesh, d, -1).reshape(-1, self.mesh.shape[d])
        made = [pg.new_group(row.tolist(), sort_ranks=False) for row in rows]
        return next((g for g in made if g.rank() >= 0), None)

    @property
    def ndim(self):
        return self.mesh.ndim

    @property
    def shape(self):
        return tuple(self.mesh.shape)

    def _dim(self, mesh_dim):
        """The index of a dimension given by index or name (None: the only one)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"this DeviceMesh has {self.ndim} dimensions "
                                 f"{self.mesh_dim_names}: name one (mesh_dim=)")
            return 0
        if isinstance(mesh_dim, str):
            if mesh_dim not in (self.mesh_dim_names or ()):
                raise KeyError(f"mesh dimension {mesh_dim!r} is not one of "
                               f"{self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if not 0 <= mesh_dim < self.ndim:
            raise IndexError(f"mesh_dim {mesh_dim} outside 0..{self.ndim - 1}")
        return mesh_dim

    def __getitem__(self, name):
        """The 1-D mesh of dimension ``name`` through this rank (its group made already)."""
        d = self._dim(name)
        index = [slice(None) if i == d else c for i, c in enumerate(self._coordinate)]
        names = (self.mesh_dim_names[d],) if self.mesh_dim_names else None
        return DeviceMesh(self.device_type, self.mesh[tuple(index)], mesh_dim_names=names,
                          _groups=[self._groups[d]])

    def get_group(self, mesh_dim=None):
        """The ProcessGroup of this rank along ``mesh_dim`` (for the collectives' ``group=``)."""
        return self._groups[self._dim(mesh_dim)]

    def size(self, mesh_dim=None):
        return self.mesh.size if mesh_dim is None else self.mesh.shape[self._dim(mesh_dim)]

    def get_local_rank(self, mesh_dim=None):
        return self._coordinate[self._dim(mesh_dim)]

    def get_coordinate(self):
        return self._coordinate

    def get_rank(self):
        return pg.get_rank()

    def __repr__(self):
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"


def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None, backend_override=None):
    """A DeviceMesh of every rank in ``mesh_shape`` (its product the world size), starting the
    default process group if need be, as torch's does."""
    if not pg.is_initialized():
        pg.init_process_group()
    shape = tuple(mesh_shape) if isinstance(mesh_shape, (tuple, list)) else (mesh_shape,)
    if not shape or not all(isinstance(n, int) and n >= 1 for n in shape):
        raise ValueError(f"init_device_mesh: mesh_shape {mesh_shape!r} must be positive integers")
    world = pg.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(f"init_device_mesh: mesh_shape {shape} holds {math.prod(shape)} ranks "
                         f"but the job has {world} (mpiexec -n {math.prod(shape)})")
    _dim_names(mesh_dim_names, len(shape))
    return DeviceMesh(device_type, np.arange(world).reshape(shape), mesh_dim_names=mesh_dim_names)
