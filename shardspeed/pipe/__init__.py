"""Pipeline parallelism with DeepSpeed's API (``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``) on
torch.distributed.pipelining's schedules; see docs/parallelism.md."""
from .module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
