"""Autotuning: a cost model calibrated by two short runs picks which configs to run (see docs/autotuning.md).

``space`` enumerates candidates; ``model`` predicts their memory and step time (``memory``: the memory prior
from ``shardspeed.estimate.estimate_peak``); ``trials`` runs one config
as a subprocess with a timeout; ``search`` drives calibration, pruning and trials; ``report`` writes
DeepSpeed's results layout; ``probe`` is the engine's side of a trial (measure, write metrics, exit).
"""
