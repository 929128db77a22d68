"""The package of benchmarks/dataplane_throughput.py's Flower app: Flower loads dpbench.server_app:app
and dpbench.client_app:app (../pyproject.toml), with the app directory on sys.path."""
