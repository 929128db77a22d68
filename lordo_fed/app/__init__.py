"""The Flower run's settings (`config.AppConfig`, its presets) and Flower's records (`records`).

The fixed choices below are here, not in `config`, because lighter layers need them without
importing AppConfig's tree (which imports torch): the data plane checks a ticket's checksum kind
(lordo_fed/transport/checksum.py) in processes that never load a model.
"""

CHECKSUMS = ("xxh3", "sha256")
"""The data plane's checksum kinds (`data-plane-checksum`), the default first (lordo_fed.transport.checksum says why)."""
