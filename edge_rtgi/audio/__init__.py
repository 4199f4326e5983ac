"""Audio plumbing: PCM conversion, resampling, ring buffer, WAV files, microphone and speaker.

ASR works on mono float32 at 16 kHz; TTS engines produce mono int16 at their voice's rate.
Everything here converts between those and the outside world.
"""

from edge_rtgi.audio.devices import MicrophoneSource, SpeakerSink, has_output_device
from edge_rtgi.audio.pcm import Resampler, downmix, float32_to_pcm16, pcm16_to_float32, resample, to_mono_16k
from edge_rtgi.audio.ring import RingBuffer
from edge_rtgi.audio.wav import WavSource, parse_wav_bytes, read_wav, read_wav_mono, wav_bytes, write_wav

ASR_SAMPLE_RATE_HZ = 16000

__all__ = [
    "ASR_SAMPLE_RATE_HZ",
    "MicrophoneSource",
    "Resampler",
    "RingBuffer",
    "SpeakerSink",
    "WavSource",
    "downmix",
    "float32_to_pcm16",
    "has_output_device",
    "parse_wav_bytes",
    "pcm16_to_float32",
    "read_wav",
    "read_wav_mono",
    "resample",
    "to_mono_16k",
    "wav_bytes",
    "write_wav",
]
