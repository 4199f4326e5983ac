"""One Wyoming connection: read events (bounded), dispatch them to the services, answer errors.

Home Assistant opens a connection per request (``describe``, or ``transcribe`` + audio, or
``detect`` + audio, or ``synthesize``, or a ``transcript`` for the assistant), but one
connection may carry any number of requests, one after another.

Bad input never takes the daemon down, nor another connection:

- a frame that cannot be read (not JSON, a length over the limits, a truncated event) is
  answered with an ``error`` event and the connection is closed (the stream cannot be
  resynchronised);
- a well-framed event that cannot be acted on (an unknown type, a missing field, audio in an
  unsupported format, audio without ``transcribe`` or ``detect``) gets an ``error`` event,
  drops the request in progress if it was about one, and the connection carries on.
"""

from __future__ import annotations

import asyncio
import logging

from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Describe
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop
from wyoming.wake import Detect

from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.server.wyoming.asr import AsrRequest
from edge_rtgi.server.wyoming.framing import FrameError, FrameLimits, linger, read_event
from edge_rtgi.server.wyoming.handle import Conversation
from edge_rtgi.server.wyoming.services import WyomingServices
from edge_rtgi.server.wyoming.streams import AudioStream, StreamFormat, WyomingRequestError
from edge_rtgi.server.wyoming.tts import TtsRequest
from edge_rtgi.server.wyoming.wake import WakeRequest

log = logging.getLogger(__name__)

AudioRequest = AsrRequest | WakeRequest

KNOWN_EVENTS = (
    "describe",
    "ping",
    "transcribe",
    "detect",
    "audio-start",
    "audio-chunk",
    "audio-stop",
    "synthesize",
    "synthesize-start",
    "synthesize-chunk",
    "synthesize-stop",
    "transcript",
)


class WyomingHandler(AsyncEventHandler):
    """The server side of one connection."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        services: WyomingServices,
        connections: set[WyomingHandler] | None = None,
    ):
        super().__init__(reader, writer)
        self.services = services
        self.connections = connections if connections is not None else set()
        self.connections.add(self)  # until the connection ends (the server's limit counts them)
        cfg = services.config
        self.limits = FrameLimits(cfg.max_event_bytes, cfg.max_payload_bytes, cfg.frame_timeout_s)
        self._audio_for: AudioRequest | None = None  # made by transcribe or detect
        self._stream: AudioStream | None = None  # between audio-start and audio-stop
        self._dropped_stream = False  # the stream's request failed: ignore it until audio-stop
        self._tts: TtsRequest | None = None  # a synthesize-start stream
        self._conversation: Conversation | None = None

    async def run(self) -> None:
        """Read events until the client leaves, a frame is unreadable, or the server stops."""
        self._is_running = True
        try:
            while self._is_running:
                try:
                    event = await self._next_event()
                except FrameError as exc:
                    await self._error(exc.code, exc.message, exc.hint)
                    await self.disconnect()  # before the half-close: nothing may write after it
                    await linger(self.reader, self.writer)
                    break
                if event is None:
                    break
                await self._handle_safely(event)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away mid-write
        finally:
            try:
                await self.disconnect()
            finally:
                self.connections.discard(self)
                self.writer.close()

    async def _next_event(self) -> Event | None:
        """The next event; inside an open request it must come within ``request_idle_s``."""
        in_request = self._audio_for is not None or self._tts is not None  # what holds a session
        if not in_request:
            return await read_event(self.reader, self.limits)
        idle_s = self.services.config.request_idle_s
        try:
            return await asyncio.wait_for(read_event(self.reader, self.limits), idle_s)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
            raise FrameError(
                "timeout",
                f"no event for {idle_s:g} s inside a request",
                hint="send the request's audio (or text) and its stop event without long pauses",
            ) from None

    async def _handle_safely(self, event: Event) -> None:
        try:
            await self.handle_event(event)
        except WyomingRequestError as exc:
            await self._drop_request(event)
            await self._error(exc.code, exc.message, exc.hint)
        except EdgeRtgiError as exc:
            await self._drop_request(event)
            await self._error("invalid_request", exc.message, exc.hint)
        except (KeyError, TypeError, ValueError) as exc:  # the library's from_event on bad data
            await self._drop_request(event)
            await self._error("invalid_event", f"{event.type}: missing or malformed field ({exc})")
        except ConnectionError:
            raise  # the client went away: run() ends the connection
        except Exception as exc:  # one event's failure must not end the connection
            log.exception("wyoming: %s failed", event.type)
            await self._drop_request(event)
            await self._error(
                "internal",
                f"{event.type}: the server failed on this event ({type(exc).__name__}: {exc})",
                hint="the request was dropped; the connection goes on",
            )

    async def handle_event(self, event: Event) -> bool:
        kind = event.type
        if Describe.is_type(kind):
            await self.write_event(self.services.info_event)
        elif Ping.is_type(kind):
            await self.write_event(Pong(text=Ping.from_event(event).text).event())
        elif Transcribe.is_type(kind):
            await self._new_audio_request(
                AsrRequest(self.services, Transcribe.from_event(event), self.write_event)
            )
        elif Detect.is_type(kind):
            await self._new_audio_request(
                WakeRequest(self.services, Detect.from_event(event), self.write_event)
            )
        elif AudioStart.is_type(kind) or AudioChunk.is_type(kind) or AudioStop.is_type(kind):
            await self._audio(event)
        elif Synthesize.is_type(kind):
            if self._tts is None:  # inside a stream it repeats the streamed text, for old servers
                _check_voice(event)
                synthesize = Synthesize.from_event(event)
                await TtsRequest(self.services, synthesize.voice, self.write_event).speak(synthesize.text)
        elif SynthesizeStart.is_type(kind):
            if self._tts is not None:  # not raised: the open stream goes on
                await self._error(
                    "invalid_event",
                    "synthesize-start inside a synthesis stream: its chunks go to the open one",
                    hint="end each stream with synthesize-stop before the next synthesize-start",
                )
                return True
            _check_voice(event)
            self._tts = TtsRequest(self.services, SynthesizeStart.from_event(event).voice, self.write_event)
        elif SynthesizeChunk.is_type(kind):
            await self._streamed_tts(kind).push(SynthesizeChunk.from_event(event).text)
        elif SynthesizeStop.is_type(kind):
            tts, self._tts = self._streamed_tts(kind), None
            await tts.finish()
        elif Transcript.is_type(kind):
            if not isinstance(event.data.get("text"), str):
                raise WyomingRequestError("invalid_event", "transcript: 'text' must be a string")
            if self._conversation is None:
                self._conversation = Conversation(self.services, self.write_event)
            await self._conversation.handle(Transcript.from_event(event).text)
        else:
            raise WyomingRequestError(
                "unknown_event",
                f"unknown event type {kind!r}",
                hint=f"this server handles: {', '.join(KNOWN_EVENTS)}",
            )
        return True

    async def write_event(self, event: Event) -> None:
        await async_write_event(event, self.writer)

    async def disconnect(self) -> None:
        """Close whatever the connection had open (sessions end, engine requests abort)."""
        if self._audio_for is not None:
            await self._audio_for.close()
            self._audio_for = None
        if self._conversation is not None:
            await self._conversation.close()

    # ------------------------------------------------------------------ audio requests

    async def _new_audio_request(self, request: AudioRequest) -> None:
        if self._audio_for is not None:  # the previous one never got its audio-stop
            await self._audio_for.close()
        self._audio_for, self._stream, self._dropped_stream = request, None, False

    async def _audio(self, event: Event) -> None:
        if self._dropped_stream:  # the rest of a refused stream, starts included, up to its audio-stop
            if AudioStop.is_type(event.type):
                self._dropped_stream = False
        elif AudioStart.is_type(event.type):
            request = self._audio_for
            if request is None:
                raise WyomingRequestError(
                    "no_request",
                    "audio-start without a transcribe or detect before it",
                    hint="send transcribe (speech to text) or detect (wake word) first",
                )
            if self._stream is not None:
                raise WyomingRequestError(
                    "invalid_event",
                    "audio-start inside an audio stream",
                    hint="end each stream with audio-stop; the request was dropped",
                )
            fmt = StreamFormat.checked(event.data)
            self._stream, self._dropped_stream = AudioStream(fmt, self.services.config.max_audio_s), False
            await request.start(fmt)
        elif self._stream is None or self._audio_for is None:
            raise WyomingRequestError(
                "no_request", f"{event.type} without an audio-start", hint="send audio-start first"
            )
        elif AudioChunk.is_type(event.type):
            await self._audio_for.chunk(self._stream.chunk(event.data, event.payload))
        else:  # audio-stop: the request's answer
            request, self._stream = self._audio_for, None
            try:
                await request.stop()
            finally:  # only now: a client that leaves during stop() still has it closed
                if self._audio_for is request:
                    self._audio_for = None

    async def _drop_request(self, event: Event) -> None:
        """After an error about ``event``: drop the request it belonged to."""
        if event.type.startswith("audio-"):  # ignore the rest of this stream, quietly
            if self._audio_for is not None:
                await self._audio_for.close()
            self._audio_for, self._stream = None, None
            self._dropped_stream = not AudioStop.is_type(event.type)
        elif event.type.startswith("synthesize"):
            self._tts = None

    def _streamed_tts(self, kind: str) -> TtsRequest:
        if self._tts is None:
            raise WyomingRequestError(
                "no_request", f"{kind} without a synthesize-start", hint="send synthesize-start first"
            )
        return self._tts

    async def _error(self, code: str, message: str, hint: str | None = None) -> None:
        """Send an ``error`` event (nothing when the client is gone)."""
        text = f"{message} ({hint})" if hint else message
        log.info("wyoming error to client: %s: %s", code, text)
        try:
            await self.write_event(Error(text=text, code=code).event())
        except ConnectionError:
            pass


def _check_voice(event: Event) -> None:
    """``voice`` must be an object or absent (the library takes a string for no voice at all)."""
    voice = event.data.get("voice")
    if voice is not None and not isinstance(voice, dict):
        raise WyomingRequestError(
            "invalid_event",
            f"{event.type}: 'voice' must be an object such as {{\"name\": ...}}, got {voice!r}",
            hint="describe lists the voices",
        )
