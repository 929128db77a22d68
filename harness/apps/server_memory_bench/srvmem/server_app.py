"""The product ServerApp."""

import server.app

app = server.app.app
