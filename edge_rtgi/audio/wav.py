"""WAV files: a strict RIFF reader, a PCM16 writer, and a paced chunk source.

The reader parses RIFF chunks itself (the stdlib ``wave`` module rejects IEEE-float and
WAVE_FORMAT_EXTENSIBLE files and reports truncation vaguely). It accepts 8/16/24/32-bit
integer PCM and 32/64-bit float, any channel count, any rate, and says precisely what is
wrong with a file it cannot read. Streams whose header carries no length (``espeak-ng
--stdout`` and other pipes write 0 or 0xFFFFFFFF) are read to the end of the data.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from edge_rtgi.audio.pcm import downmix, float32_to_pcm16, resample
from edge_rtgi.errors import AudioError

_FORMAT_PCM = 1
_FORMAT_FLOAT = 3
_FORMAT_EXTENSIBLE = 0xFFFE
_UNKNOWN_SIZES = (0, 0xFFFFFFFF, 0x7FFFFFFF, 0x7FFFF000)


def _parse_fmt(body: bytes, where: str) -> tuple[int, int, int, int]:
    if len(body) < 16:
        raise AudioError(f"{where}: 'fmt ' chunk is {len(body)} bytes, expected at least 16")
    fmt, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", body[:16])
    if fmt == _FORMAT_EXTENSIBLE and len(body) >= 26:
        fmt = struct.unpack("<H", body[24:26])[0]  # first two bytes of the sub-format GUID
    if fmt not in (_FORMAT_PCM, _FORMAT_FLOAT):
        raise AudioError(
            f"{where}: unsupported WAV encoding (format tag {fmt:#x})",
            hint="convert to PCM or float WAV, e.g. `sox in.wav -e signed -b 16 out.wav`",
        )
    if channels == 0 or rate == 0:
        raise AudioError(f"{where}: WAV header says {channels} channels at {rate} Hz")
    if (fmt == _FORMAT_PCM and bits not in (8, 16, 24, 32)) or (
        fmt == _FORMAT_FLOAT and bits not in (32, 64)
    ):
        raise AudioError(f"{where}: unsupported sample width {bits} bits for format {fmt}")
    if block_align != channels * bits // 8:
        raise AudioError(
            f"{where}: inconsistent WAV header (block align {block_align}, "
            f"{channels} channels of {bits} bits)"
        )
    return fmt, channels, rate, bits


def _decode(data: bytes, fmt: int, bits: int, channels: int) -> np.ndarray:
    frame = channels * bits // 8
    data = data[: len(data) - len(data) % frame]
    if fmt == _FORMAT_FLOAT:
        x = np.frombuffer(data, dtype="<f4" if bits == 32 else "<f8").astype(np.float32)
    elif bits == 8:
        x = (np.frombuffer(data, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif bits == 16:
        x = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    elif bits == 24:
        raw = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)) << 8 >> 8  # sign-extend
        x = ints.astype(np.float32) / 8388608.0
    else:
        x = np.frombuffer(data, dtype="<i4").astype(np.float32) / 2147483648.0
    return x.reshape(-1, channels) if channels > 1 else x


def parse_wav_bytes(blob: bytes, where: str = "<bytes>") -> tuple[np.ndarray, int]:
    """Decode a complete WAV file held in memory; see ``read_wav``."""
    if len(blob) < 12 or blob[:4] not in (b"RIFF", b"RIFX") or blob[8:12] != b"WAVE":
        raise AudioError(
            f"{where}: not a WAV file (no RIFF/WAVE header)",
            hint="give a .wav file; convert other formats with sox or ffmpeg",
        )
    if blob[:4] == b"RIFX":
        raise AudioError(f"{where}: big-endian RIFX WAV is not supported", hint="convert with sox")
    pos, fmt_info = 12, None
    while pos + 8 <= len(blob):
        chunk_id, size = blob[pos : pos + 4], struct.unpack("<I", blob[pos + 4 : pos + 8])[0]
        body_start = pos + 8
        if chunk_id != b"data" and body_start + size > len(blob):
            raise AudioError(
                f"{where}: truncated WAV file: the {chunk_id.decode('latin-1')!r} chunk is cut short",
                hint="the file was cut short; re-record or re-export it",
            )
        if chunk_id == b"fmt ":
            fmt_info = _parse_fmt(blob[body_start : body_start + size], where)
        elif chunk_id == b"data":
            if fmt_info is None:
                raise AudioError(f"{where}: WAV 'data' chunk comes before its 'fmt ' chunk")
            available = len(blob) - body_start
            if size in _UNKNOWN_SIZES or size > 0x7F000000:
                size = available  # a streamed WAV: read what is there
            elif size > available:
                raise AudioError(
                    f"{where}: truncated WAV file: header promises {size} bytes of audio, "
                    f"only {available} present",
                    hint="the file was cut short; re-record or re-export it",
                )
            fmt, channels, rate, bits = fmt_info
            return _decode(blob[body_start : body_start + size], fmt, bits, channels), rate
        pos = body_start + size + (size & 1)
    if fmt_info is None:
        raise AudioError(f"{where}: truncated or invalid WAV file: no 'fmt ' chunk")
    raise AudioError(f"{where}: truncated WAV file: no 'data' chunk", hint="the file was cut short")


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a WAV file as float32 samples in [-1, 1] and its sample rate in Hz.

    Returns ``[N]`` for mono and ``[N, C]`` for multi-channel files. Raises ``AudioError``
    naming the problem for a missing, truncated or unsupported file.
    """
    path = Path(path)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise AudioError(f"audio file not found: {path}") from None
    except OSError as exc:
        raise AudioError(f"cannot read audio file {path}: {exc.strerror or exc}") from None
    return parse_wav_bytes(blob, str(path))


def read_wav_mono(path: str | Path, sample_rate_hz: int = 16000) -> np.ndarray:
    """Read any supported WAV as mono float32 at ``sample_rate_hz`` (down-mixed, resampled)."""
    samples, rate = read_wav(path)
    return resample(downmix(samples), rate, sample_rate_hz)


def wav_bytes(samples: np.ndarray, sample_rate_hz: int) -> bytes:
    """Encode float32 (or int16) ``[N]``/``[N, C]`` samples as a 16-bit PCM WAV file."""
    pcm = samples if samples.dtype == np.int16 else float32_to_pcm16(samples)
    channels = 1 if pcm.ndim == 1 else pcm.shape[1]
    data = pcm.astype("<i2").tobytes()
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + len(data),
        b"WAVE",
        b"fmt ",
        16,
        _FORMAT_PCM,
        channels,
        sample_rate_hz,
        sample_rate_hz * channels * 2,
        channels * 2,
        16,
        b"data",
        len(data),
    )
    return header + data


def write_wav(path: str | Path, samples: np.ndarray, sample_rate_hz: int) -> None:
    """Write float32 or int16 samples as a 16-bit PCM WAV file."""
    try:
        Path(path).write_bytes(wav_bytes(samples, sample_rate_hz))
    except OSError as exc:
        raise AudioError(f"cannot write WAV file {path}: {exc.strerror or exc}") from None


class WavSource:
    """Async iterator over a WAV file as mono float32 chunks at ``sample_rate_hz``.

    ``realtime=True`` paces chunks by the wall clock as a microphone would deliver them
    (without drift: each chunk is due at ``start + chunk_end_time``); ``realtime=False``
    yields them as fast as the consumer takes them. ``tail_silence_ms`` appends silence so
    that a VAD endpoint can fire after the last word, as it would with a live speaker.
    """

    def __init__(
        self,
        path: str | Path,
        chunk_ms: int = 20,
        realtime: bool = True,
        sample_rate_hz: int = 16000,
        tail_silence_ms: int = 0,
    ):
        if chunk_ms <= 0:
            raise AudioError(f"chunk_ms must be positive, got {chunk_ms}")
        self.path = Path(path)
        self.chunk_ms, self.realtime, self.sample_rate_hz = chunk_ms, realtime, sample_rate_hz
        samples = read_wav_mono(self.path, sample_rate_hz)
        tail = np.zeros(sample_rate_hz * tail_silence_ms // 1000, dtype=np.float32)
        self.samples = np.concatenate([samples, tail])

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate_hz

    async def __aiter__(self) -> AsyncIterator[np.ndarray]:
        step = max(1, self.sample_rate_hz * self.chunk_ms // 1000)
        start = time.monotonic()
        for i in range(0, len(self.samples), step):
            if self.realtime:
                due = start + (i + step) / self.sample_rate_hz
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let other tasks run between chunks
            yield self.samples[i : i + step]
