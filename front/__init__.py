"""Our OpenAI-compatible HTTP front: the container's default, and the local-testing front.

`python -m front --host HOST --port PORT [--api-key KEY] -- python -m handler` spawns the handler exactly as the
production daemon does (a socketpair with `HFENDPOINT_FD`, stderr relayed) and forwards each request's whole body.
Unlike hfendpoint v0.3.0 it answers /health 503 until the handler is ready, carries the handler's error statuses,
checks a bearer key, serves /metrics and drains on SIGTERM (see front/server.py).
"""
