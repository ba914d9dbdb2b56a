"""The config of the same run at another ZeRO stage and offload: what :func:`~shardspeed.plan.decide` is
given to plan each row of a stage × offload table (``shardspeed estimate``), written where the config's
sections are known, so that the table itself speaks only in stages and offload devices."""
from __future__ import annotations

import copy
from typing import Any, Dict, Mapping


def zero_variant(base: Mapping[str, Any], stage: int, offload_optimizer: str = "none", offload_param: str = "none",
                 nvme_path: str = "/local_nvme") -> Dict[str, Any]:
    """A copy of the config ``base`` with ``zero_optimization.stage`` and the offload devices ("none", "cpu" or
    "nvme") replaced, nothing else touched: an offload block of ``base`` keeps its other keys, an NVMe one gets
    ``nvme_path`` unless it has one, and "none" removes the block. Whether the combination is valid is
    decide's to say."""
    cfg = copy.deepcopy(dict(base))
    zero = dict(cfg.get("zero_optimization") or {})
    zero["stage"] = stage
    for key, dev in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        block = dict(zero.get(key) or {})
        if dev == "none":
            zero.pop(key, None)
            continue
        block["device"] = dev
        if dev == "nvme":
            block.setdefault("nvme_path", nvme_path)
        zero[key] = block
    cfg["zero_optimization"] = zero
    return cfg
