"""The echo app's package: Flower loads its components as lordofed_echo.server_app:app and
lordofed_echo.client_app:app (../pyproject.toml), with the app directory on sys.path."""
