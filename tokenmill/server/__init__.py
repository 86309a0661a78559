"""The OpenAI-compatible HTTP server: ``tokenmill serve`` (see launcher.run_server)."""
