"""The one exception type of the Realtime adapter, and the ``error`` event it becomes.

Every problem with a client event is raised as ``RealtimeProtocolError`` where it is found
(parsing, base64, audio format, session fields, conversation state) and turned into one
``error`` server event with the standard fields: ``type``, ``code``, ``message``, ``param``
and the offending client ``event_id``. The session stays open.
"""

from __future__ import annotations

from edge_rtgi.errors import EdgeRtgiError


class RealtimeProtocolError(EdgeRtgiError):
    """A client event the adapter cannot accept.

    ``code`` is a short machine-readable reason (``invalid_json``, ``unknown_event``,
    ``invalid_base64``, ``unsupported_audio_format``...); ``param`` is the dotted path of
    the offending field when there is one.
    """

    def __init__(
        self, code: str, message: str, param: str | None = None, error_type: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.code = code
        self.param = param
        self.error_type = error_type
        self.client_event_id: str | None = None  # set when known before the event was understood

    def to_error(self, client_event_id: str | None) -> dict:
        """The ``error`` object of an ``error`` server event."""
        return {
            "type": self.error_type,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "event_id": client_event_id,
        }
