"""Process groups, the (pipe, data, model) mesh topology, DeepSpeed's group names, and logged collectives."""
from .comms import Collectives, CommHandle, CommRecord, CommsLogger
from .init import DEFAULT_TIMEOUT_S, default_backend, init_distributed, local_device, shutdown_distributed
from .mpu import MeshMPU
from .topology import MESH_DIMS, Topology, mesh_sizes

__all__ = [
    "CommHandle", "CommRecord", "Collectives", "CommsLogger", "DEFAULT_TIMEOUT_S", "default_backend",
    "init_distributed", "local_device", "shutdown_distributed", "Topology", "MESH_DIMS", "mesh_sizes", "MeshMPU",
]
