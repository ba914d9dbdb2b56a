"""Re-exports :mod:`shardspeed.mesh.replicas` (which copy of a parameter counts in the global gradient norm)
under the name it was published with."""
from ..mesh.replicas import TENSOR_PARALLEL_ATTR, counts_in_norm, is_tensor_parallel, mark_replica, mark_tensor_parallel

__all__ = ["TENSOR_PARALLEL_ATTR", "counts_in_norm", "is_tensor_parallel", "mark_replica", "mark_tensor_parallel"]
