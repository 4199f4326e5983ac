"""The daemon: WebSocket server with health and metrics (app), the native protocol (protocol,
native), the OpenAI Realtime adapter (openai_realtime/), and the live CLI client (client)."""
