"""espeak-ng: IPA phonemes for Piper voices (through the C library) and a speech engine
(through the ``espeak-ng`` program) for languages without a Piper voice.

espeak-ng is GPL-3; we load the system library with ctypes or run the program, so it stays
a separate, optional component (see README, Licences). The library keeps global state
(current voice, internal buffers) and is not thread-safe, so every call holds one lock.

``espeak_TextToPhonemes`` returns one clause per call and drops the punctuation that ended
it. Piper voices were trained on phonemes *with* punctuation (piper-phonemize gets it from
a patched espeak), so we split clauses ourselves, phonemise each piece and put the mark back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator

import numpy as np

from edge_rtgi.errors import ConfigError, EdgeRtgiError
from edge_rtgi.tts.segmenter import is_abbreviation, split_sentences
from edge_rtgi.tts.text import check_text

log = logging.getLogger(__name__)

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_CHARS_UTF8 = 1
_PHONEMES_IPA = 0x02
# A clause ends at punctuation followed by whitespace or the end ("3.14" and "1,000" stay whole).
_CLAUSE = re.compile(r"(.+?)([,;:.!?]+)(?=\s|$)|(.+)$", re.DOTALL)
_LANG_SWITCH = re.compile(r"\([a-z]{2,3}(?:-[a-z0-9]+)?\)")


class EspeakError(EdgeRtgiError):
    """espeak-ng is missing or failed."""


def _find_library() -> str:
    name = ctypes.util.find_library("espeak-ng")
    if name:
        return name
    for candidate in ("libespeak-ng.so.1", "libespeak-ng.so"):
        try:
            ctypes.CDLL(candidate)
            return candidate
        except OSError:
            continue
    try:  # the espeakng-loader wheel bundles the library and its data
        import espeakng_loader

        return espeakng_loader.get_library_path()
    except ImportError:
        raise EspeakError(
            "libespeak-ng is not installed", hint="apt-get install espeak-ng (scripts/setup.sh does)"
        ) from None


def _clauses(text: str) -> list[tuple[str, str]]:
    """(words, punctuation) pieces; an abbreviation's period does not end a clause."""
    out: list[tuple[str, str]] = []
    carry = ""
    for m in _CLAUSE.finditer(text.strip()):
        words, marks = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), "")
        words = carry + words
        last = words.split()[-1] if words.split() else ""
        if marks == "." and is_abbreviation(last.lstrip("(\"'")):
            carry = words + ". "  # keep "Dr." with the name after it; espeak expands it
            continue
        carry = ""
        out.append((words, marks))
    if carry.strip():
        out.append((carry.strip(), ""))
    return out


class EspeakPhonemizer:
    """Text -> IPA phoneme string, one instance per process (use ``get``)."""

    _instance: EspeakPhonemizer | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        lib = ctypes.CDLL(_find_library())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        data_path = None
        if "espeakng_loader" in str(getattr(lib, "_name", "")):
            import espeakng_loader

            data_path = espeakng_loader.get_data_path().encode()
        if lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path, 0) <= 0:
            raise EspeakError("espeak-ng failed to initialise (its data files may be missing)")
        self._lib = lib
        self._voice: str | None = None

    @classmethod
    def get(cls) -> EspeakPhonemizer:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _set_voice(self, voice: str) -> None:
        if voice != self._voice:
            if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise ConfigError(
                    f"espeak-ng has no voice {voice!r}", hint="list voices with `espeak-ng --voices`"
                )
            self._voice = voice

    def _phonemize_piece(self, piece: str) -> str:
        buf = ctypes.create_string_buffer(piece.encode("utf-8"))
        ptr = ctypes.c_void_p(ctypes.addressof(buf))
        parts = []
        while ptr.value:
            out = self._lib.espeak_TextToPhonemes(ctypes.byref(ptr), _CHARS_UTF8, _PHONEMES_IPA)
            if out:
                parts.append(out.decode("utf-8").strip())
        return " ".join(p for p in parts if p)

    def phonemize(self, text: str, voice: str = "en-us") -> str:
        """IPA phonemes for ``text``, with its clause punctuation kept (piper's convention)."""
        pieces = []
        with self._lock:
            self._set_voice(voice)
            for words, marks in _clauses(text):
                ipa = _LANG_SWITCH.sub("", self._phonemize_piece(words)).strip() if words.strip() else ""
                pieces.append(ipa + marks[:1])
        return " ".join(p for p in pieces if p)


class EspeakEngine:
    """Speech from the ``espeak-ng`` program, sentence by sentence, streamed as it is made.

    Each sentence runs ``espeak-ng --stdout``; its WAV output is read in blocks while the
    program is still writing, so the first audio arrives after the first few milliseconds
    of synthesis rather than after the whole text.
    """

    sample_rate_hz = 22050

    def __init__(self, voice: str = "en-us", speed_wpm: int = 165):
        program = shutil.which("espeak-ng")
        if program is None:
            raise EspeakError(
                "the espeak-ng program is not installed",
                hint="apt-get install espeak-ng (scripts/setup.sh does)",
            )
        self.program = program
        self.voice, self.speed_wpm = voice, speed_wpm
        probe = subprocess.run([self.program, "-v", voice, "-q", "x"], capture_output=True, text=True)
        if probe.returncode != 0 or "not found" in (probe.stderr or "").lower():
            raise ConfigError(
                f"espeak-ng has no voice {voice!r}", hint="list voices with `espeak-ng --voices`"
            )

    def _sentence_pcm(self, sentence: str, block_samples: int = 4096) -> Iterator[np.ndarray]:
        cmd = [self.program, "--stdout", "-v", self.voice, "-s", str(self.speed_wpm), "--", sentence]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
            stdout = proc.stdout
            if stdout is None:  # stdout=PIPE always gives a pipe
                raise EspeakError("espeak-ng was started without an output pipe")
            header = stdout.read(44)
            if len(header) < 44 or header[:4] != b"RIFF":
                raise EspeakError(f"espeak-ng produced no audio for {sentence[:40]!r}")
            rate = int.from_bytes(header[24:28], "little")
            if rate != self.sample_rate_hz:
                self.sample_rate_hz = rate
            while True:
                data = stdout.read(block_samples * 2)
                if not data:
                    break
                yield np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2").astype(np.int16)
            proc.wait()

    def synthesize_stream(self, text: str) -> Iterator[np.ndarray]:
        """Yield int16 PCM chunks at ``sample_rate_hz``; see ``TtsEngine``."""
        for sentence in split_sentences(check_text(text)):
            yield from self._sentence_pcm(sentence)
