"""The daemon's HTTP face beside its WebSockets: the OpenAI-compatible text API
(``openai_api``), the browser client and its static files (``browser``, ``static/``), and the
single-use WebSocket tickets browsers log in with (``tickets``)."""
