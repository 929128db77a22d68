"""Flower ServerApp of lordo-fed: the LoRDO strategy around the library's Aggregator."""
