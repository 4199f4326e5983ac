"""The ``tts`` service: ``synthesize`` -> ``audio-start``, ``audio-chunk``..., ``audio-stop``;
and streaming text: ``synthesize-start``, ``synthesize-chunk``..., ``synthesize-stop`` ->
audio as clauses complete, then ``audio-stop`` and ``synthesize-stopped``.

It uses the daemon's loaded voices (``Resources.voice``) and the TTS stage's clause
segmenter, so the first clause of a streamed text is spoken while the rest still arrives.
A voice is chosen by name, else by language, else the served pipeline's voice. Home
Assistant sends a plain ``synthesize`` with the whole text inside a stream too, for older
servers; it is ignored there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.tts import SynthesizeStopped, SynthesizeVoice

from edge_rtgi.errors import EdgeRtgiError
from edge_rtgi.pipeline.config import TtsStageConfig
from edge_rtgi.server.wyoming.services import EventWriter, WyomingServices
from edge_rtgi.server.wyoming.streams import WyomingRequestError
from edge_rtgi.tts import ClauseSegmenter, TtsEngine, check_text, synthesize_async

SAMPLES_PER_CHUNK = 1024  # as wyoming-piper sends them


def _pick_voice(services: WyomingServices, voice: SynthesizeVoice | None) -> str:
    names = [v.name for v in services.voices]
    if not names:
        raise WyomingRequestError("no_service", "this daemon has no TTS voice loaded")
    fields = {"name": voice.name, "language": voice.language} if voice is not None else {}
    for key, value in fields.items():
        if value is not None and not isinstance(value, str):
            raise WyomingRequestError("invalid_event", f"the voice's {key!r} must be a string, got {value!r}")
    if voice is not None and voice.name:
        if voice.name not in names:
            raise WyomingRequestError(
                "unknown_voice", f"unknown voice {voice.name!r}", hint=f"voices: {', '.join(names)}"
            )
        return voice.name
    if voice is not None and voice.language:
        want = voice.language.replace("-", "_").lower()
        for v in services.voices:  # exact (en_US), then by language alone (en)
            if v.language.lower() == want:
                return v.name
        for v in services.voices:
            if v.language.split("_")[0].lower() == want.split("_")[0]:
                return v.name
        raise WyomingRequestError(
            "unknown_voice",
            f"no voice for language {voice.language!r}",
            hint=f"languages: {', '.join(v.language for v in services.voices)}",
        )
    tts: TtsStageConfig | None = services.pipeline.stage(TtsStageConfig)
    return tts.voice if tts is not None else names[0]


class TtsRequest:
    """One synthesis: a whole text, or a text stream."""

    def __init__(self, services: WyomingServices, voice: SynthesizeVoice | None, write: EventWriter):
        self.write = write
        self.engine: TtsEngine = services.daemon.resources.voice(_pick_voice(services, voice))
        self.rate_hz = self.engine.sample_rate_hz
        cfg = services.pipeline.stage(TtsStageConfig) or TtsStageConfig()
        self.segmenter = ClauseSegmenter(
            cfg.first_clause_min_words, first_break_after_words=cfg.first_break_after_words
        )
        self._audio_started = False

    async def speak(self, text: str) -> None:
        """The whole of ``text``, one audio stream."""
        try:
            check_text(text)
        except EdgeRtgiError as exc:
            raise WyomingRequestError("invalid_text", exc.message, exc.hint) from None
        await self._speak(text)
        await self._end_audio()

    async def push(self, text: str) -> None:
        """More streamed text: speak the clauses it completes."""
        for clause in self.segmenter.push(text):
            await self._speak(clause)

    async def finish(self) -> None:
        """The end of the text stream: speak the rest, end the audio, ``synthesize-stopped``."""
        for clause in self.segmenter.flush():
            await self._speak(clause)
        await self._end_audio()
        await self.write(SynthesizeStopped().event())

    async def _speak(self, text: str) -> None:
        try:
            check_text(text)
        except EdgeRtgiError:
            return  # punctuation or markup only: nothing to say
        async for pcm in synthesize_async(self.engine, text):
            await self._send(pcm)

    async def _send(self, pcm: np.ndarray) -> None:
        fmt: dict[str, Any] = {"rate": self.rate_hz, "width": 2, "channels": 1}
        if not self._audio_started:
            self._audio_started = True
            await self.write(AudioStart(**fmt).event())
        for i in range(0, len(pcm), SAMPLES_PER_CHUNK):
            part = pcm[i : i + SAMPLES_PER_CHUNK].astype("<i2").tobytes()
            await self.write(AudioChunk(audio=part, **fmt).event())

    async def _end_audio(self) -> None:
        if not self._audio_started:  # nothing was spoken: an empty stream all the same
            await self.write(AudioStart(rate=self.rate_hz, width=2, channels=1).event())
        await self.write(AudioStop().event())
        self._audio_started = False
