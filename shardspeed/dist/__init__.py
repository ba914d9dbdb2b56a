"""Process groups, topology and logged collectives (torch.distributed underneath)."""
from .comms import CommHandle, CommRecord, Collectives, CommsLogger
from .init import DEFAULT_TIMEOUT_S, default_backend, init_distributed, local_device
from .topology import Topology

__all__ = [
    "CommHandle", "CommRecord", "Collectives", "CommsLogger", "DEFAULT_TIMEOUT_S", "default_backend",
    "init_distributed", "local_device", "Topology",
]
