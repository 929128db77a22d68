"""What crosses the network: compression codecs (lordo_fed.wire.compress)."""
