"""Audio formats of the OpenAI Realtime protocol: base64 PCM16 at 24 kHz, G.711 mu-law and A-law.

The stdlib ``audioop`` module is gone in Python 3.13, so G.711 is done here with numpy lookup
tables: decoding is a 256-entry table, encoding a 65,536-entry table indexed by the int16
sample's bit pattern. Both tables follow ITU-T G.711 (the same bit layout as ``audioop``'s
``lin2ulaw`` / ``lin2alaw``), so the output interoperates with telephony stacks.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np

from edge_rtgi.server.openai_realtime.errors import RealtimeProtocolError

PCM16_RATE_HZ = 24_000  # the only rate the protocol allows for audio/pcm
G711_RATE_HZ = 8_000

SUPPORTED_FORMAT_TYPES = ("audio/pcm", "audio/pcmu", "audio/pcma")
# Beta spellings of the same formats (``input_audio_format: "pcm16"`` and so on).
BETA_FORMAT_NAMES = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


@dataclass(frozen=True)
class AudioFormat:
    """One wire audio format: its protocol name and its fixed sample rate."""

    type: str = "audio/pcm"

    def __post_init__(self) -> None:
        if self.type not in SUPPORTED_FORMAT_TYPES:
            raise ValueError(f"unsupported audio format {self.type!r}")

    @property
    def sample_rate_hz(self) -> int:
        return PCM16_RATE_HZ if self.type == "audio/pcm" else G711_RATE_HZ

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.type == "audio/pcm" else 1

    def to_wire(self) -> dict:
        """The GA ``format`` object for session events."""
        if self.type == "audio/pcm":
            return {"type": "audio/pcm", "rate": PCM16_RATE_HZ}
        return {"type": self.type}


def parse_format(value: object, param: str) -> AudioFormat:
    """Read a GA format object (``{"type": "audio/pcm", "rate": 24000}``) or a beta name.

    Raises ``RealtimeProtocolError`` (code ``unsupported_audio_format``) naming ``param``.
    """
    if isinstance(value, str):
        name = BETA_FORMAT_NAMES.get(value, value)
        rate = None
    elif isinstance(value, dict):
        name = value.get("type", "audio/pcm")
        rate = value.get("rate")
        unknown = sorted(set(value) - {"type", "rate"})
        if unknown:
            raise RealtimeProtocolError(
                "unknown_parameter", f"unknown field {unknown[0]!r} in audio format", f"{param}.{unknown[0]}"
            )
    else:
        raise RealtimeProtocolError(
            "invalid_type", f'{param} must be an object like {{"type": "audio/pcm", "rate": 24000}}', param
        )
    if not isinstance(name, str) or name not in SUPPORTED_FORMAT_TYPES:
        raise RealtimeProtocolError(
            "unsupported_audio_format",
            f"unsupported audio format {name!r}; supported: audio/pcm (24000 Hz), audio/pcmu, audio/pcma",
            f"{param}.type" if isinstance(value, dict) else param,
        )
    fmt = AudioFormat(name)
    if rate is not None and rate != fmt.sample_rate_hz:
        raise RealtimeProtocolError(
            "unsupported_audio_format",
            f"unsupported sample rate {rate!r} for {name}; it must be {fmt.sample_rate_hz}",
            f"{param}.rate",
        )
    return fmt


# --------------------------------------------------------------------------- G.711 tables

_ULAW_BIAS = 0x84


def _ulaw_encode_all() -> np.ndarray:
    # Same arithmetic as the reference (Sun / CCITT) encoder: 14-bit magnitude, bias 0x21,
    # segment search, then bits inverted (mask 0x7F for negative samples, 0xFF otherwise).
    x = np.arange(-32768, 32768, dtype=np.int32) >> 2
    negative = x < 0
    mag = np.minimum(np.where(negative, -x, x), 8159) + (_ULAW_BIAS >> 2)
    seg_ends = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
    seg = np.searchsorted(seg_ends, mag, side="left")
    code = np.where(seg >= 8, 0x7F, (seg << 4) | ((mag >> (seg + 1)) & 0x0F))  # clipped: top code
    return (code ^ np.where(negative, 0x7F, 0xFF)).astype(np.uint8)


def _ulaw_decode_all() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    mag = (((mantissa << 3) + _ULAW_BIAS) << exponent) - _ULAW_BIAS
    return np.where(sign != 0, -mag, mag).astype(np.int16)


def _alaw_encode_all() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int32) >> 3  # A-law works on 13-bit magnitudes
    positive = x >= 0
    mag = np.where(positive, x, -x - 1)
    mag = np.minimum(mag, 0x0FFF)
    exponent = np.where(mag < 32, 0, np.floor(np.log2(np.maximum(mag, 1))).astype(np.int32) - 4)
    exponent = np.clip(exponent, 0, 7)
    mantissa = np.where(exponent == 0, mag >> 1, mag >> exponent) & 0x0F
    code = (exponent << 4) | mantissa
    code = np.where(positive, code | 0x80, code)
    return (code ^ 0x55).astype(np.uint8)


def _alaw_decode_all() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    exponent = (a >> 4) & 0x07
    mantissa = a & 0x0F
    mag = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0)
    )
    return np.where(a & 0x80, mag, -mag).astype(np.int16)


_ULAW_ENCODE = _ulaw_encode_all()
_ULAW_DECODE = _ulaw_decode_all()
_ALAW_ENCODE = _alaw_encode_all()
_ALAW_DECODE = _alaw_decode_all()


def _table_index(pcm: np.ndarray) -> np.ndarray:
    return pcm.astype(np.int16, copy=False).astype(np.int32) + 32768


def ulaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples -> G.711 mu-law bytes."""
    return _ULAW_ENCODE[_table_index(pcm)].tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    """G.711 mu-law bytes -> int16 samples."""
    return _ULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def alaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples -> G.711 A-law bytes."""
    return _ALAW_ENCODE[_table_index(pcm)].tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    """G.711 A-law bytes -> int16 samples."""
    return _ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


# --------------------------------------------------------------------------- base64 <-> samples


def decode_base64(text: object, param: str) -> bytes:
    """Strict base64 decoding; anything else is a ``RealtimeProtocolError`` naming ``param``."""
    if not isinstance(text, str):
        raise RealtimeProtocolError("invalid_type", f"{param} must be a base64 string", param)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RealtimeProtocolError(
            "invalid_base64", f"{param} is not valid base64 ({exc}); send base64-encoded audio bytes", param
        ) from None


def bytes_to_pcm(data: bytes, fmt: AudioFormat, param: str) -> np.ndarray:
    """Wire bytes in ``fmt`` -> int16 samples at ``fmt.sample_rate_hz``."""
    if fmt.type == "audio/pcmu":
        return ulaw_decode(data)
    if fmt.type == "audio/pcma":
        return alaw_decode(data)
    if len(data) % 2:
        raise RealtimeProtocolError(
            "invalid_audio",
            f"{param} holds {len(data)} bytes, an odd count, so it is not 16-bit PCM; "
            "audio/pcm must be little-endian int16 samples",
            param,
        )
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


def pcm_to_bytes(pcm: np.ndarray, fmt: AudioFormat) -> bytes:
    """int16 samples at ``fmt.sample_rate_hz`` -> wire bytes in ``fmt``."""
    if fmt.type == "audio/pcmu":
        return ulaw_encode(pcm)
    if fmt.type == "audio/pcma":
        return alaw_encode(pcm)
    return np.asarray(pcm, dtype="<i2").tobytes()


def encode_base64(pcm: np.ndarray, fmt: AudioFormat) -> str:
    """int16 samples -> the base64 string of an ``output_audio.delta``."""
    return base64.b64encode(pcm_to_bytes(pcm, fmt)).decode("ascii")
