"""`kvedge serve`: the on-device chatbot service (OpenAI-compatible HTTP over one `Model`).

config.py (YAML -> ServiceConfig), protocol.py (the OpenAI wire format), scheduler.py (slot pool and
the one scheduler thread), app.py (Starlette routes), metrics.py (Prometheus text), service.py
(uvicorn, shutdown, `--check`), systemd.py (the boot unit), client.py (`kvedge chat --url`).
Needs the `serve` extra: `pip install 'kvedge[serve]'`.
"""
