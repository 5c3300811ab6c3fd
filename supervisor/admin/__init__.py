"""The admin side: the API (api.py), the status view it serves (status_view.py), the status page and
its event stream, the admin token, and the CLI's client (client.py)."""
