"""Process groups and the mesh: creating the default group (``init``), the named-dimension
:class:`Topology` and its groups (``topology``), and DeepSpeed's group getters over it (``mpu``).
The collectives run over these groups live in :mod:`shardspeed.comm`."""
from .init import DEFAULT_TIMEOUT_S, default_backend, init_distributed, local_device, shutdown_distributed
from .mpu import MeshMPU
from .topology import MESH_DIMS, Topology, mesh_sizes

__all__ = [
    "DEFAULT_TIMEOUT_S", "default_backend", "init_distributed", "local_device", "shutdown_distributed",
    "Topology", "MESH_DIMS", "mesh_sizes", "MeshMPU",
]
