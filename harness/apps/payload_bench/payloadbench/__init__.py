"""The package of benchmarks/payload_throughput.py's Flower app: Flower loads
payloadbench.server_app:app and payloadbench.client_app:app (../pyproject.toml), with the app
directory on sys.path."""
