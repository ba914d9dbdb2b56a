"""Model parallelism: tensor-parallel layers and plans, and what pipeline and tensor parallelism share.

:mod:`.replicas` says which parameters a rank counts in the global gradient norm.
"""
from .replicas import counts_in_norm, is_tensor_parallel, mark_replica, mark_tensor_parallel

__all__ = ["counts_in_norm", "is_tensor_parallel", "mark_replica", "mark_tensor_parallel"]
