"""PCM conversion, resampling, ring buffer and WAV parsing (no models)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from edge_rtgi.audio import (
    Resampler,
    RingBuffer,
    downmix,
    float32_to_pcm16,
    parse_wav_bytes,
    pcm16_to_float32,
    read_wav,
    read_wav_mono,
    resample,
    wav_bytes,
    write_wav,
)
from edge_rtgi.errors import AudioError


def _tone(freq_hz: float, rate_hz: int, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(rate_hz * seconds)) / rate_hz
    return (0.5 * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)


def _peak_hz(x: np.ndarray, rate_hz: int) -> float:
    x = x[len(x) // 10 : -len(x) // 10]
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate_hz / len(x))


def test_pcm_round_trip_and_clipping():
    pcm = np.array([-32768, -1, 0, 1, 32767], dtype=np.int16)
    assert np.array_equal(float32_to_pcm16(pcm16_to_float32(pcm)), pcm)
    assert np.array_equal(pcm16_to_float32(pcm.tobytes()), pcm16_to_float32(pcm))
    assert list(float32_to_pcm16(np.array([2.0, -2.0]))) == [32767, -32768]
    with pytest.raises(AudioError, match="odd length"):
        pcm16_to_float32(b"\x00\x01\x02")


def test_downmix_averages_channels():
    stereo = np.stack([np.ones(4, np.float32), np.zeros(4, np.float32)], axis=1)
    assert np.allclose(downmix(stereo), 0.5)
    assert downmix(np.ones(3, np.float32)).shape == (3,)


@pytest.mark.parametrize(
    "src,dst", [(44100, 16000), (48000, 16000), (8000, 16000), (16000, 22050), (22050, 16000)]
)
def test_resample_keeps_tone_frequency_amplitude_and_length(src, dst):
    y = resample(_tone(1000.0, src), src, dst)
    assert len(y) == int(np.ceil(src * dst / src))
    assert abs(_peak_hz(y, dst) - 1000.0) < 3.0
    rms = float(np.sqrt(np.mean(y[len(y) // 10 : -len(y) // 10] ** 2)))
    assert rms == pytest.approx(0.5 / np.sqrt(2), rel=0.01)


def test_resample_rejects_aliases():
    # 12 kHz cannot exist at 16 kHz; a naive decimator folds it to 4 kHz.
    y = resample(_tone(12000.0, 48000), 48000, 16000)
    assert float(np.sqrt(np.mean(y[200:-200] ** 2))) < 1e-3


def test_streaming_resampler_equals_one_call():
    x = np.random.default_rng(0).standard_normal(22050).astype(np.float32) * 0.1
    whole = resample(x, 22050, 16000)
    rs = Resampler(22050, 16000)
    sizes = [1, 7, 441, 1000, 13]
    parts, pos, i = [], 0, 0
    while pos < len(x):
        parts.append(rs.process(x[pos : pos + sizes[i % len(sizes)]]))
        pos += sizes[i % len(sizes)]
        i += 1
    parts.append(rs.flush())
    assert np.allclose(np.concatenate(parts), whole, atol=1e-6)


def test_ring_buffer_absolute_indexing_and_wrap():
    rb = RingBuffer(100)
    rb.write(np.arange(70))
    rb.write(np.arange(70, 150))
    assert (rb.total_written, rb.oldest_index, len(rb)) == (150, 50, 100)
    assert np.array_equal(rb.read(95, 105), np.arange(95, 105))
    assert np.array_equal(rb.latest(3), [147, 148, 149])
    rb.write(np.arange(150, 400))  # larger than the ring: only its tail survives
    assert rb.oldest_index == 300 and np.array_equal(rb.read(395), np.arange(395, 400))
    with pytest.raises(AudioError, match="cannot read"):
        rb.read(10, 20)


def _wav(
    fmt_tag: int, channels: int, rate: int, bits: int, data: bytes, declared: int | None = None
) -> bytes:
    size = len(data) if declared is None else declared
    fmt = struct.pack(
        "<HHIIHH", fmt_tag, channels, rate, rate * channels * bits // 8, channels * bits // 8, bits
    )
    return (
        b"RIFF"
        + struct.pack("<I", min(36 + size, 0xFFFFFFFF))
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", size)
        + data
    )


def test_wav_formats_decode_to_the_same_signal():
    x = _tone(440.0, 8000, 0.1)
    i16 = float32_to_pcm16(x)
    ints = (x.astype(np.float64) * 8388607).astype(np.int32)
    b24 = b"".join(int(v & 0xFFFFFF).to_bytes(3, "little") for v in ints)
    cases = {
        "pcm16": _wav(1, 1, 8000, 16, i16.tobytes()),
        "pcm24": _wav(1, 1, 8000, 24, b24),
        "float32": _wav(3, 1, 8000, 32, x.astype("<f4").tobytes()),
        "pcm8": _wav(1, 1, 8000, 8, (np.round(x * 127) + 128).astype(np.uint8).tobytes()),
    }
    for name, blob in cases.items():
        y, rate = parse_wav_bytes(blob, name)
        assert rate == 8000 and y.shape == x.shape, name
        assert np.max(np.abs(y - x)) < 0.01, name


def test_write_read_stereo_and_mono_16k(tmp_path):
    stereo = np.stack([_tone(500, 44100, 0.5), _tone(500, 44100, 0.5)], axis=1)
    path = tmp_path / "s.wav"
    write_wav(path, stereo, 44100)
    y, rate = read_wav(path)
    assert rate == 44100 and y.shape == stereo.shape
    mono = read_wav_mono(path)
    assert len(mono) == 8000 and abs(_peak_hz(mono, 16000) - 500) < 3


def test_truncated_and_invalid_wavs_give_clear_errors(tmp_path):
    good = wav_bytes(np.zeros(1000, np.float32), 16000)
    with pytest.raises(
        AudioError, match="truncated WAV file: header promises 2000 bytes of audio, only 1000"
    ):
        parse_wav_bytes(good[: 44 + 1000])
    with pytest.raises(AudioError, match="not a WAV file"):
        parse_wav_bytes(b"ID3\x03 this is an mp3")
    with pytest.raises(AudioError, match="no 'fmt ' chunk|truncated"):
        parse_wav_bytes(good[:20])
    with pytest.raises(AudioError, match="unsupported WAV encoding"):
        parse_wav_bytes(_wav(0x55, 1, 16000, 16, b"\x00" * 10))
    with pytest.raises(AudioError, match="audio file not found"):
        read_wav(tmp_path / "missing.wav")
    # Streamed WAVs (espeak-ng --stdout) declare an unknown length: read what is there.
    y, _ = parse_wav_bytes(_wav(1, 1, 16000, 16, b"\x00\x10" * 50, declared=0xFFFFFFFF))
    assert len(y) == 50
