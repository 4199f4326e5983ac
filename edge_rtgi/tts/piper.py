"""Piper (VITS) voices through onnxruntime, with espeak-ng phonemes.

A Piper voice is an ``.onnx`` graph plus an ``.onnx.json`` with the sample rate, the espeak
voice, the inference scales and the phoneme -> id map. Ids follow piper-phonemize: BOS
``^``, then every phoneme followed by the pad ``_``, then EOS ``$``. Synthesis runs one
sentence at a time so the first sentence can play while the rest is still being made.
"""

from __future__ import annotations

import json
import logging
import threading
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_rtgi.errors import ModelFileError
from edge_rtgi.tts.espeak import EspeakPhonemizer
from edge_rtgi.tts.segmenter import split_sentences
from edge_rtgi.tts.text import check_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PiperConfig:
    """What synthesis needs from a voice's ``.onnx.json``."""

    sample_rate_hz: int
    espeak_voice: str
    noise_scale: float
    length_scale: float
    noise_w: float
    phoneme_id_map: dict[str, list[int]]
    num_speakers: int = 1

    @classmethod
    def load(cls, path: Path) -> PiperConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            inference = raw.get("inference", {})
            if raw.get("phoneme_type", "espeak") != "espeak":
                raise ModelFileError(
                    f"{path}: phoneme_type {raw['phoneme_type']!r} is not supported (only espeak)"
                )
            return cls(
                int(raw["audio"]["sample_rate"]),
                raw["espeak"]["voice"],
                float(inference.get("noise_scale", 0.667)),
                float(inference.get("length_scale", 1.0)),
                float(inference.get("noise_w", 0.8)),
                {k: list(v) for k, v in raw["phoneme_id_map"].items()},
                int(raw.get("num_speakers", 1)),
            )
        except FileNotFoundError:
            raise ModelFileError(
                f"Piper voice config not found: {path}",
                hint="a voice needs both VOICE.onnx and VOICE.onnx.json",
            ) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"{path}: not a valid Piper voice config ({exc!r})") from None


def _voice_files(path: Path, config_json: Path | None) -> tuple[Path, Path]:
    """Accept a folder holding one voice, or the .onnx file itself."""
    if path.is_dir():
        found = sorted(path.glob("*.onnx"))
        if len(found) != 1:
            raise ModelFileError(f"expected one Piper .onnx voice in {path}, found {len(found)}")
        path = found[0]
    if not path.is_file():
        raise ModelFileError(
            f"Piper voice model not found: {path}", hint="run `edge-rtgi models pull piper-en_US-joe-medium`"
        )
    return path, config_json or path.with_name(path.name + ".json")


def _providers() -> list[str]:
    import onnxruntime

    available = onnxruntime.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class PiperVoice:
    """A Piper voice. ``synthesize_stream`` yields int16 chunks, one per sentence."""

    def __init__(
        self,
        onnx_path: str | Path,
        config_json: str | Path | None = None,
        intra_op_threads: int = 0,
        speaker_id: int = 0,
    ):
        import onnxruntime

        onnx_file, json_file = _voice_files(Path(onnx_path), Path(config_json) if config_json else None)
        self.config = PiperConfig.load(json_file)
        self.sample_rate_hz = self.config.sample_rate_hz
        self.speaker_id = speaker_id
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        # Synthesis shares the cores with the LLM decoding the rest of the reply (and with ASR):
        # threads that spin between kernels burn CPU the others need (measured: docs/daemon.md).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # A memory pattern is planned per input shape, and every sentence is a new length: with
        # them the arena kept growing over hundreds of sentences; without, it levels off lower at
        # about the same speed (docs/reliability.md, "RSS: what grows").
        opts.enable_mem_pattern = False
        opts.log_severity_level = 3
        try:
            self._session = onnxruntime.InferenceSession(
                str(onnx_file), sess_options=opts, providers=_providers()
            )
        except Exception as exc:  # noqa: BLE001 - onnxruntime has its own exception types
            raise ModelFileError(
                f"cannot load Piper voice {onnx_file}: {exc}",
                hint="the file may be truncated; re-pull it with `edge-rtgi models pull --force`",
            ) from None
        self._input_names = {i.name for i in self._session.get_inputs()}
        self._phonemizer = EspeakPhonemizer.get()
        self._run_lock = threading.Lock()
        self._unknown_logged: set[str] = set()

    def phoneme_ids(self, phonemes: str) -> list[int]:
        """piper-phonemize's id sequence: ^ _ p1 _ p2 _ ... $ (unknown phonemes skipped)."""
        id_map = self.config.phoneme_id_map
        pad = id_map["_"]
        ids = list(id_map["^"]) + list(pad)
        for ch in phonemes:
            mapped = id_map.get(ch)
            if mapped is None:
                # Some voices list decomposed forms (a base letter + combining mark).
                decomposed = unicodedata.normalize("NFD", ch)
                if all(c in id_map for c in decomposed):
                    for c in decomposed:
                        ids += id_map[c] + pad
                elif ch not in self._unknown_logged:
                    self._unknown_logged.add(ch)
                    log.debug("phoneme %r not in the voice's map; skipped", ch)
                continue
            ids += mapped + pad
        return ids + list(id_map["$"])

    def synthesize_ids(self, ids: list[int]) -> np.ndarray:
        """Run the VITS graph on one id sequence; int16 PCM at ``sample_rate_hz``."""
        cfg = self.config
        feeds = {
            "input": np.asarray([ids], dtype=np.int64),
            "input_lengths": np.asarray([len(ids)], dtype=np.int64),
            "scales": np.asarray([cfg.noise_scale, cfg.length_scale, cfg.noise_w], dtype=np.float32),
        }
        if "sid" in self._input_names:
            feeds["sid"] = np.asarray([self.speaker_id], dtype=np.int64)
        with self._run_lock:  # one session, one run at a time keeps memory and latency predictable
            audio = self._session.run(None, feeds)[0]
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        return np.clip(audio * 32767.0, -32768, 32767).astype(np.int16)

    def synthesize_stream(self, text: str) -> Iterator[np.ndarray]:
        """Yield one int16 chunk per sentence of ``text``; see ``TtsEngine``."""
        for sentence in split_sentences(check_text(text)):
            phonemes = self._phonemizer.phonemize(sentence, self.config.espeak_voice)
            if phonemes.strip():
                yield self.synthesize_ids(self.phoneme_ids(phonemes))
