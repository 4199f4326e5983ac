"""OpenAI Realtime API compatibility: ``/v1/realtime`` on the daemon (see docs/openai-realtime.md).

A thin adapter over the protocol-neutral session core (``edge_rtgi.pipeline.session``):
``events`` and ``session_config`` parse client events, ``codecs`` handles the wire audio
formats, ``conversation`` and ``response`` format items and responses, ``adapter`` maps the
two directions, and ``connection.serve_connection`` is what the daemon calls per WebSocket.
"""

from edge_rtgi.server.openai_realtime.connection import serve_connection

__all__ = ["serve_connection"]
