"""Translation back ends: Apertium (a subprocess) and an LLM prompt on the shared engine.

Apertium is Debian's rule-based translator (GPL-2, run as a separate program). It is the
embedded default here because the offline default LLM cannot translate. Mode names use
ISO 639-3 codes (``eng-spa``); the pipeline speaks ISO 639-1 (``en``/``es``).
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess

from edge_rtgi.errors import ConfigError, RequestError

ISO_639_3 = {
    "en": "eng",
    "es": "spa",
    "fr": "fra",
    "de": "deu",
    "it": "ita",
    "pt": "por",
    "ca": "cat",
    "gl": "glg",
    "eu": "eus",
    "ro": "ron",
    "nl": "nld",
    "sv": "swe",
    "da": "dan",
    "nb": "nob",
    "nn": "nno",
    "oc": "oci",
    "eo": "epo",
    "cy": "cym",
    "br": "bre",
    "ga": "gle",
}
LANGUAGE_NAMES = {
    "en": "English",
    "es": "Spanish",
    "fr": "French",
    "de": "German",
    "it": "Italian",
    "pt": "Portuguese",
    "ca": "Catalan",
    "nl": "Dutch",
}


@functools.lru_cache(maxsize=1)
def apertium_modes() -> tuple[str, ...]:
    """The installed Apertium modes (``apertium -l``), or () when Apertium is absent."""
    exe = shutil.which("apertium")
    if exe is None:
        return ()
    out = subprocess.run([exe, "-l"], capture_output=True, text=True, timeout=30, check=False)
    return tuple(line.strip() for line in out.stdout.splitlines() if line.strip())


def apertium_mode(source_language: str, target_language: str, override: str | None = None) -> str:
    """The Apertium mode for a language pair; ConfigError naming what to install if absent."""
    src = ISO_639_3.get(source_language, source_language)
    dst = ISO_639_3.get(target_language, target_language)
    mode = override or f"{src}-{dst}"
    if shutil.which("apertium") is None:
        raise ConfigError(
            "the translate stage uses Apertium, but the 'apertium' program is not installed",
            hint=f"apt-get install apertium apertium-{src}-{dst} (scripts/setup.sh does)",
        )
    modes = apertium_modes()
    if mode not in modes:
        raise ConfigError(
            f"Apertium has no mode {mode!r} for {source_language}->{target_language}",
            hint=f"installed modes: {', '.join(modes) or 'none'}; try apt-get install apertium-{src}-{dst}",
        )
    return mode


class ApertiumTranslator:
    """One ``apertium -u <mode>`` process per utterance (a short-lived process; no state to keep warm)."""

    def __init__(
        self, source_language: str, target_language: str, pair: str | None = None, timeout_s: float = 10.0
    ):
        self.mode = apertium_mode(source_language, target_language, pair)
        self.timeout_s = timeout_s

    async def translate(self, text: str) -> str:
        """Translate one utterance. The subprocess is awaited, never blocking the event loop."""
        proc = await asyncio.create_subprocess_exec(
            "apertium",
            "-u",
            self.mode,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(text.encode("utf-8")), self.timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise RequestError(f"apertium took longer than {self.timeout_s:.0f} s to translate") from None
        except asyncio.CancelledError:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        if proc.returncode != 0:
            raise RequestError(f"apertium {self.mode} failed: {err.decode(errors='replace').strip()[:200]}")
        return " ".join(out.decode("utf-8", errors="replace").split())


def translation_messages(text: str, source_language: str, target_language: str) -> list[dict]:
    """A chat prompt asking an instruction-tuned LLM for a bare translation."""
    src = LANGUAGE_NAMES.get(source_language, source_language)
    dst = LANGUAGE_NAMES.get(target_language, target_language)
    return [
        {
            "role": "system",
            "content": f"You translate {src} into {dst}. Reply with the {dst} "
            "translation only, with no notes or quotes.",
        },
        {"role": "user", "content": text},
    ]


# Example pairs for the few-shot prompt (none of them is in the benchmark's translation sets).
FEW_SHOT_EXAMPLES: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("en", "es"): (
        (
            "My sister plays the guitar every weekend.",
            "Mi hermana toca la guitarra todos los fines de semana.",
        ),
        ("The bus was late because of the rain.", "El autobús llegó tarde por la lluvia."),
        ("Is there a pharmacy open near here?", "¿Hay una farmacia abierta cerca de aquí?"),
        (
            "We planted tomatoes in the garden last spring.",
            "Plantamos tomates en el jardín la primavera pasada.",
        ),
    ),
}


def translation_few_shot_prompt(text: str, source_language: str, target_language: str) -> str:
    """A raw-text prompt for a base (not instruction-tuned) LLM: example pairs, one per line
    pair, then the utterance; the translation is the rest of the line (stop at a newline).

    Pairs without examples get the instruction line only. ``translation_few_shot_prompt``'s
    figures against Apertium and SmolLM2 are in docs/benchmarks.md.
    """
    src = LANGUAGE_NAMES.get(source_language, source_language)
    dst = LANGUAGE_NAMES.get(target_language, target_language)
    lines = [f"Translate {src} into {dst}.", ""]
    for source, target in FEW_SHOT_EXAMPLES.get((source_language, target_language), ()):
        lines += [f"{src}: {source}", f"{dst}: {target}", ""]
    lines += [f"{src}: {' '.join(text.split())}", f"{dst}:"]
    return "\n".join(lines)


def translation_budget_tokens(source_tokens: int, ratio: float, minimum: int) -> int:
    """Output budget from the source length: translations run a little longer than their source."""
    return max(minimum, int(source_tokens * ratio) + 4)
