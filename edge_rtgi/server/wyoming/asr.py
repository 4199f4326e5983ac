"""The ``asr`` service: ``transcribe``, ``audio-start``, ``audio-chunk``... ``audio-stop`` ->
``transcript``.

Each request is a daemon session on the ASR-only part of the served pipeline, with manual
turns: VAD still splits the audio into utterances, and ``audio-stop`` commits; the final
``transcript`` is every utterance's final text. While the audio streams in, the words that
LocalAgreement has committed (they never change) go out as ``transcript-start`` /
``transcript-chunk`` events; ``transcript-stop`` and then ``transcript`` end the request, and
the chunks joined are the transcript's text whenever the final decode kept the committed
words (it normally does; ``transcript`` is the one to trust).
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStart, TranscriptStop

from edge_rtgi import frames as F
from edge_rtgi.pipeline.session import Session
from edge_rtgi.server.wyoming.services import EventWriter, WyomingServices
from edge_rtgi.server.wyoming.streams import StreamFormat, WyomingRequestError


class AsrRequest:
    """One transcription, from ``transcribe`` to its ``transcript``."""

    def __init__(self, services: WyomingServices, request: Transcribe, write: EventWriter):
        asr = services.asr
        if asr is None:
            raise WyomingRequestError("no_service", "this daemon's Wyoming pipeline has no asr stage")
        language = asr.language or "en"
        if request.language is not None and not isinstance(request.language, str):
            raise WyomingRequestError(
                "invalid_event", "transcribe: 'language' must be a string such as \"en\""
            )
        if request.language and request.language.split("-")[0].split("_")[0] != language:
            raise WyomingRequestError(
                "unsupported_language",
                f"the ASR model {asr.model} transcribes {language!r}, not {request.language!r}",
                hint=f"ask for language {language!r} (describe lists the models and languages)",
            )
        self.services, self.write, self.language = services, write, language
        self.session: Session | None = None
        self._pump: asyncio.Task[None] | None = None
        self._committed = asyncio.Event()
        self._finals: list[str] = []
        self._streamed: dict[int, str] = {}  # turn -> committed text already sent as chunks
        self._started = False

    async def start(self, fmt: StreamFormat) -> None:
        self.session = await self.services.open_session(
            "asr", turn_detection=False, auto_response=False, input_sample_rate_hz=fmt.rate_hz
        )
        self._pump = asyncio.create_task(self._read_events(self.session))

    async def chunk(self, pcm: np.ndarray) -> None:
        if self.session is not None and len(pcm):
            await self.session.push_audio(pcm)

    async def stop(self) -> None:
        """Commit, wait for the finals, send the end of the transcript."""
        if self.session is None:
            return
        try:
            await self.session.commit_audio()
            await self._committed.wait()
            text = " ".join(t for t in self._finals if t).strip()
            sent = " ".join(t for t in self._streamed.values() if t)
            if self._started:
                if text.startswith(sent) and text[len(sent) :].strip():
                    await self.write(TranscriptChunk(text=text[len(sent) :]).event())
                await self.write(TranscriptStop().event())
            await self.write(Transcript(text=text, language=self.language).event())
        finally:  # also when the client left before the answer could be written
            await self.close()

    async def close(self) -> None:
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)  # it may have died on a gone client
        session, self.session = self.session, None
        if session is not None:
            await self.services.daemon.close_session(session)

    async def _read_events(self, session: Session) -> None:
        try:
            async for event in session.events():
                if isinstance(event, F.Transcript) and event.final:
                    self._finals.append(event.text)
                elif isinstance(event, F.Transcript) and event.committed_text:
                    with contextlib.suppress(ConnectionError):  # the client left: keep reading
                        await self._stream(event.turn_id, event.committed_text)
                elif isinstance(event, F.AudioCommitted):
                    self._committed.set()
                elif isinstance(event, F.ErrorEvent):
                    with contextlib.suppress(ConnectionError):
                        await self.write_error(event)
        finally:  # stop() must never wait for a commit this pump will not see
            self._committed.set()

    async def _stream(self, turn_id: int, committed: str) -> None:
        before = self._streamed.get(turn_id, "")
        if len(committed) <= len(before) or not committed.startswith(before):
            return
        if not self._started:
            self._started = True
            await self.write(TranscriptStart(language=self.language).event())
        new = committed[len(before) :]
        if not before and any(self._streamed.values()):
            new = " " + new.lstrip()  # the first words of a later utterance
        self._streamed[turn_id] = committed
        await self.write(TranscriptChunk(text=new).event())

    async def write_error(self, event: F.ErrorEvent) -> None:
        from wyoming.error import Error

        await self.write(Error(text=event.message, code=event.code).event())
