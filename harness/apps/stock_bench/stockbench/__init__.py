"""The package of benchmarks/round_overhead.py's stock Flower app: Flower loads
stockbench.server_app:app and stockbench.client_app:app (../pyproject.toml), with the app
directory on sys.path."""
