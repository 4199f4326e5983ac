"""The daemon: one aiohttp server (app) for the native WebSocket protocol (protocol, native),
the OpenAI Realtime adapter (openai_realtime/), the OpenAI-compatible text API, the browser
client and its tickets (http/), health and Prometheus metrics (metrics); admission rules
(admission), the shared connection loop (connection), and the live CLI client (client)."""
