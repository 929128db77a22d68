"""The package of benchmarks/server_memory_deployment.py's Flower app: Flower loads
srvmem.server_app:app and srvmem.client_app:app (../pyproject.toml), with the app directory on
sys.path."""
