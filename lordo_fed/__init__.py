"""lordo-fed: LoRDO (arXiv 2602.04396) for geo-distributed LM pre-training.

The library (this package) needs no Flower: optimizer, projections, outer optimizers,
model, data, metrics and the round logic (worker and aggregator) that the Flower app wraps.
"""

__version__ = "0.1.0"
