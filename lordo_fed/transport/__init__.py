"""How a round's payloads cross the network: the gRPC data plane beside Flower's control plane.

`server` (hosted by the ServerApp), `client` (used by a node), `tokens` (capabilities bound to a
node, a round and a direction). Importable without torch and without Flower.
"""
