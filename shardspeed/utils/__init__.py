"""DeepSpeed-compatible utility modules (``shardspeed.utils.groups`` mirrors ``deepspeed.utils.groups``)."""
