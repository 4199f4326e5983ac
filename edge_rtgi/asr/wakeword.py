"""Wake-word detection: the microWakeWord models bundled in ``pymicro-wakeword`` 2.5.0.

The package ships four models (``okay_nabu``, ``hey_jarvis``, ``alexa``, ``hey_mycroft``),
each a small streaming TFLite network with its own probability cut-off and averaging window
(the model's JSON file), and the TFLite runtime that runs them. Audio goes in as 16 kHz mono
int16 PCM; features come every 10 ms and the network looks at three of them at a time, so a
detection is placed in the stream to within 30 ms.

One ``WakeWordDetector`` holds the streaming state of one audio stream (a session or a
Wyoming request); it is cheap (a model loads in a few ms, 1 s of audio takes about 10 ms on
one core) but not thread-safe: feed it from one thread at a time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edge_rtgi.errors import ConfigError

if TYPE_CHECKING:
    from pymicro_wakeword import MicroWakeWord

SAMPLE_RATE_HZ = 16000
FEATURE_STEP_MS = 10  # one frontend feature per 10 ms of audio
FEATURE_WINDOW_MS = 30  # each feature looks at 30 ms of audio


@dataclass(frozen=True)
class WakeWordInfo:
    """A bundled wake-word model: its name, the phrase it listens for, its languages."""

    name: str
    phrase: str
    languages: tuple[str, ...]
    probability_cutoff: float
    config_path: Path


@dataclass(frozen=True)
class WakeDetection:
    """A wake word was heard; ``audio_ms`` is the position in the stream where it was detected."""

    name: str
    phrase: str
    audio_ms: int


@lru_cache(maxsize=1)
def available_wake_words() -> dict[str, WakeWordInfo]:
    """The models bundled in ``pymicro-wakeword``, by name (read from their JSON files)."""
    import pymicro_wakeword

    models_dir = Path(pymicro_wakeword.__file__).parent / "models"
    out: dict[str, WakeWordInfo] = {}
    for path in sorted(models_dir.glob("*.json")):
        config = json.loads(path.read_text(encoding="utf-8"))
        out[path.stem] = WakeWordInfo(
            name=path.stem,
            phrase=config["wake_word"],
            languages=tuple(config.get("trained_languages", [])),
            probability_cutoff=float(config["micro"]["probability_cutoff"]),
            config_path=path,
        )
    return out


def check_wake_word(name: str) -> WakeWordInfo:
    """The bundled model ``name``; a ConfigError listing the available ones otherwise."""
    models = available_wake_words()
    if name not in models:
        raise ConfigError(
            f"unknown wake word {name!r}",
            hint=f"available wake words: {', '.join(models)}",
        )
    return models[name]


class WakeWordDetector:
    """Streaming detection of one or more wake words over 16 kHz mono int16 PCM.

    ``refractory_ms``: after a detection, the same word is not reported again for this long
    (its averaged probability stays above the cut-off for a few windows).
    ``probability_cutoff`` replaces every model's own cut-off when given.
    """

    def __init__(
        self,
        names: Sequence[str],
        refractory_ms: int = 2000,
        probability_cutoff: float | None = None,
    ):
        if not names:
            raise ConfigError("a wake-word detector needs at least one wake word")
        self.infos = [check_wake_word(n) for n in dict.fromkeys(names)]
        self.refractory_ms = refractory_ms
        self.probability_cutoff = probability_cutoff
        self._models: list[MicroWakeWord] = []
        self._load()

    def _load(self) -> None:
        from pymicro_wakeword import MicroWakeWord, MicroWakeWordFeatures

        for model in self._models:
            model.close()
        self._models = [MicroWakeWord.from_config(info.config_path) for info in self.infos]
        if self.probability_cutoff is not None:
            for model in self._models:
                model.probability_cutoff = self.probability_cutoff
        self._features = MicroWakeWordFeatures()
        self._features_seen = 0
        self._last_ms: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return [info.name for info in self.infos]

    @property
    def audio_ms(self) -> int:
        """How much audio the detector has turned into features so far."""
        return self._features_seen * FEATURE_STEP_MS

    def reset(self) -> None:
        """Forget the stream so far (the models' internal state too: they are reloaded)."""
        self._load()

    def process(self, pcm: np.ndarray) -> list[WakeDetection]:
        """Feed 16 kHz mono int16 PCM; the detections it completes, in stream order."""
        if pcm.dtype != np.int16 or pcm.ndim != 1:
            raise ValueError("the wake-word detector takes mono int16 PCM at 16 kHz")
        found: list[WakeDetection] = []
        for features in self._features.process_streaming(pcm.astype("<i2").tobytes()):
            self._features_seen += 1
            # the newest feature ends this far into the stream
            at_ms = self._features_seen * FEATURE_STEP_MS + FEATURE_WINDOW_MS - FEATURE_STEP_MS
            for info, model in zip(self.infos, self._models, strict=True):
                if not model.process_streaming(features):
                    continue
                last = self._last_ms.get(info.name)
                if last is not None and at_ms - last < self.refractory_ms:
                    continue
                self._last_ms[info.name] = at_ms
                found.append(WakeDetection(info.name, info.phrase, at_ms))
        return found

    def close(self) -> None:
        for model in self._models:
            model.close()
        self._models = []
