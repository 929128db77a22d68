"""The reference trainer: every method on one process, M workers run in turn (no Flower)."""
