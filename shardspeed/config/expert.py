"""`expert_parallel`: DeepSpeed's AutoEP block (Hugging Face MoE models made expert-parallel)."""
from __future__ import annotations

from typing import Optional, Union

from .base import ConfigModel, field

#: the Hugging Face families shardspeed's AutoEP converts (transformers' model_type)
PRESET_MODELS = ("mixtral", "qwen3_moe")


class ExpertParallelConfig(ConfigModel):
    """`expert_parallel`: replace a Hugging Face model's sparse MoE blocks with expert-parallel ones
    (docs/moe.md). The mesh's expert dimension is `autoep_size`."""

    enabled: bool = field(False, "Convert the model's MoE blocks at initialize.")
    autoep_size: int = field(1, "Ranks the experts are spread over (the mesh's expert dimension); it must divide "
                             "the number of experts and the data-parallel ranks.", ge=1)
    preset_model: Optional[str] = field(None, "The model family: \"mixtral\" or \"qwen3_moe\" (None: from the "
                                        "model's config.model_type).")
    moe_layer_pattern: Optional[str] = field(None, "Regex of the MoE blocks' module names (default: the preset's, "
                                             "e.g. `model.layers.N.mlp`).")
    expert_pattern: Optional[str] = field(None, "Attribute of an MoE block holding the stacked experts "
                                          "(default \"experts\").")
    router_pattern: Optional[str] = field(None, "Attribute of an MoE block holding the router (default \"gate\").")
    use_grouped_mm: bool = field(True, "Local experts in one torch._grouped_mm where the build has it (else a padded "
                                 "bmm).")
    top_k: Union[int, str] = field("auto", "Experts per token; \"auto\": the model config's.")
    score_func: str = field("softmax", "Router scores (the converted models' softmax only).",
                            not_implemented="another router score function")
    route_norm: Optional[bool] = field(None, "Renormalise the top-k weights; None: the model's.",
                                       not_implemented="overriding the model's top-k renormalisation")
    route_scale: float = field(1.0, "Factor on the routed output.", not_implemented="route scaling")
    expert_tensor_parallel_size: int = field(1, "Tensor parallelism inside experts (only 1).",
                                             not_implemented="expert tensor parallelism")
    load_balance_coeff: Optional[float] = field(None, "Auxiliary-loss-free balancing (null only).",
                                              not_implemented="auxiliary-loss-free load balancing")
