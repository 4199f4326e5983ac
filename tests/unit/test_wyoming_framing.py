"""The Wyoming server's config, its bounded event reader, and its audio format checks.

The reader is fed by a real ``asyncio.StreamReader``; what it accepts must round-trip what
the ``wyoming`` library itself writes.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys

import numpy as np
import pytest
from wyoming.audio import AudioChunk
from wyoming.event import Event, write_event

from edge_rtgi.errors import ConfigError
from edge_rtgi.server.config import WyomingConfig, load_daemon_config
from edge_rtgi.server.wyoming.framing import FrameError, FrameLimits, read_event
from edge_rtgi.server.wyoming.streams import AudioStream, StreamFormat, WyomingRequestError

LIMITS = FrameLimits(max_event_bytes=4096, max_payload_bytes=8192)


def test_config_is_strict_yaml(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("wyoming:\n  uri: tcp://127.0.0.1:10300\n  max_audio_s: 30\n")
    assert load_daemon_config(path).wyoming == WyomingConfig(uri="tcp://127.0.0.1:10300", max_audio_s=30)
    path.write_text("wyoming:\n  url: tcp://127.0.0.1:10300\n")
    with pytest.raises(ConfigError, match=r"d.yaml:2.*unknown key 'url'"):
        load_daemon_config(path)
    path.write_text("wyoming:\n  uri: http://127.0.0.1:10300\n")
    with pytest.raises(ConfigError, match="tcp://HOST:PORT or unix:///PATH"):
        load_daemon_config(path)
    assert load_daemon_config(None).wyoming.uri is None  # off by default


def test_bind_is_loopback_unless_remote_is_allowed():
    WyomingConfig(uri="tcp://127.0.0.1:10300").check_bind()
    WyomingConfig(uri="unix:///tmp/wy.sock").check_bind()
    with pytest.raises(ConfigError, match="no authentication"):
        WyomingConfig(uri="tcp://0.0.0.0:10300").check_bind()
    WyomingConfig(uri="tcp://0.0.0.0:10300", allow_remote=True).check_bind()
    assert WyomingConfig(uri="unix:///tmp/wy.sock").address() == ("unix", "/tmp/wy.sock", 0)


async def _read(data: bytes, limits: FrameLimits = LIMITS) -> Event | None:
    reader = asyncio.StreamReader(limit=limits.max_event_bytes)
    reader.feed_data(data)
    reader.feed_eof()
    return await read_event(reader, limits)


async def test_reads_what_the_library_writes():
    chunk = AudioChunk(rate=16000, width=2, channels=1, audio=np.arange(300, dtype="<i2").tobytes())
    buf = io.BytesIO()
    write_event(chunk.event(), buf)  # data goes after the header (data_length), then the payload
    event = await _read(buf.getvalue())
    assert event is not None and AudioChunk.from_event(event) == chunk
    assert await _read(b"") is None  # a clean end


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b'{"type": "audio-chunk", "payload_length": 8193}\n', "payload_too_large"),
        (b'{"type": "x", "data_length": 5000}\n', "event_too_large"),
        (b'{"type": "x", "payload_length": -1}\n', "invalid_event"),
        (b'{"type": "x", "payload_length": "7"}\n', "invalid_event"),
        (b"not json\n", "invalid_json"),
        (b"[1, 2]\n", "invalid_event"),
        (b'{"type": 3}\n', "invalid_event"),
        (b'{"type": "x", "data_length": 4}\n[1]\n', "invalid_event"),
        (b'{"type": "x", "payload_length": 100}\nshort', "invalid_event"),
        (b'{"type": "x"', "invalid_event"),
        (b"y" * 5000 + b"\n", "event_too_large"),
        # nested past the recursion limit (where a Python parses it, it is no object)
        (b"[" * 4000 + b"\n", "invalid_json|invalid_event"),
        (b'{"type": "x", "data_length": 3}\n' + b"[" * 3, "invalid_json"),
    ],
)
async def test_bad_frames_raise_with_a_code(data, code):
    with pytest.raises(FrameError) as info:
        await _read(data)
    assert info.value.code in code.split("|"), info.value.message


async def test_lengths_are_checked_before_reading():
    # a huge payload_length is refused at once, without waiting for (or buffering) the bytes
    reader = asyncio.StreamReader(limit=LIMITS.max_event_bytes)
    reader.feed_data(json.dumps({"type": "audio-chunk", "payload_length": 1 << 40}).encode() + b"\n")
    with pytest.raises(FrameError, match="over this server's limit"):
        await asyncio.wait_for(read_event(reader, LIMITS), 5)


@pytest.mark.skipif(not getattr(sys, "get_int_max_str_digits", lambda: 0)(), reason="no int digit limit")
async def test_an_integer_past_pythons_digit_limit_is_unreadable_json():
    limits = FrameLimits(max_event_bytes=65536, max_payload_bytes=8192)
    with pytest.raises(FrameError) as info:
        await _read(b'{"type": "x", "n": ' + b"9" * 5000 + b"}\n", limits)
    assert info.value.code == "invalid_json"


async def test_an_event_that_stalls_after_its_header_times_out():
    limits = FrameLimits(max_event_bytes=4096, max_payload_bytes=8192, frame_timeout_s=0.2)
    reader = asyncio.StreamReader(limit=limits.max_event_bytes)
    reader.feed_data(b'{"type": "describe", "data_length": 100}\n{')  # and nothing more, no EOF
    with pytest.raises(FrameError) as info:
        await asyncio.wait_for(read_event(reader, limits), 5)
    assert info.value.code == "timeout" and "0.2 s" in info.value.message
    with pytest.raises(ValueError, match="frame_timeout_s"):
        WyomingConfig(frame_timeout_s=0)
    with pytest.raises(ValueError, match="request_idle_s"):
        WyomingConfig(request_idle_s=-1)


def test_audio_formats():
    fmt = StreamFormat.checked({"rate": 16000, "width": 2, "channels": 2})
    stereo = np.array([100, 300, -50, -150], "<i2").tobytes()
    assert fmt.to_mono(stereo).tolist() == [200, -100]
    with pytest.raises(WyomingRequestError, match="width 3 bytes.*5 channels") as info:
        StreamFormat.checked({"rate": 16000, "width": 3, "channels": 5})
    assert info.value.code == "unsupported_audio"
    with pytest.raises(WyomingRequestError, match="rate 4000 Hz"):
        StreamFormat.checked({"rate": 4000, "width": 2, "channels": 1})
    for rate in ("fast", "16000", 16000.5, float("inf"), True, None):  # JSON integers only
        with pytest.raises(WyomingRequestError) as info:
            StreamFormat.checked({"rate": rate, "width": 2, "channels": 1})
        assert info.value.code == "invalid_event", rate
    with pytest.raises(WyomingRequestError, match="not a whole number"):
        fmt.to_mono(b"\x00\x01\x02")


def test_an_audio_stream_is_bounded_and_keeps_its_format():
    stream = AudioStream(StreamFormat(16000, 2, 1), max_audio_s=1.0)
    data = {"rate": 16000, "width": 2, "channels": 1}
    assert len(stream.chunk(data, bytes(16000))) == 8000 and stream.audio_ms == 500
    with pytest.raises(WyomingRequestError, match="differs from its audio-start"):
        stream.chunk({**data, "rate": 22050}, bytes(4))
    with pytest.raises(WyomingRequestError) as info:
        stream.chunk(data, bytes(16002))
    assert info.value.code == "audio_too_long"
