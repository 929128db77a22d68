"""Flower ClientApp of lordo-fed: K local LoRDO steps per round through the library's Worker."""
