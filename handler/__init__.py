"""The handler process: the daemon protocol in front, the engine Worker behind (`python -m handler`)."""
