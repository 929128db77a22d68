"""Inner optimizers: LoRDO's local step (low-rank Adam + full-rank QH term) and its config."""

from lordo_fed.optim.batched import BatchedLoRDO
from lordo_fed.optim.lordo import LoRDO
from lordo_fed.optim.rotation import change_of_basis, rotate_moments

__all__ = ["BatchedLoRDO", "LoRDO", "change_of_basis", "rotate_moments"]
