"""Peer engines on the same model and the same token ids: HF transformers, CTranslate2, llama.cpp.

Every peer exposes ``stream(request, cancel)``, a blocking iterator of ``(token ids, text)``
pieces, so the load generator serves it through ``ThreadedTarget`` exactly like our plain
path, and ``decode_benchmark`` times all of them the same way. Greedy decoding everywhere;
``ignore_eos`` requests generate exactly ``max_tokens`` tokens (HF: ``min_new_tokens``,
CTranslate2: ``min_length``, llama.cpp: we simply do not stop at EOS).

The HF peer needs an HF folder. The catalogue holds a GGUF file, so transformers' own GGUF
loader dequantises it once and the folder is cached under the model cache
(``<cache>/bench-peers/<name>-hf``); the CTranslate2 model is converted from that folder with
``ctranslate2.converters.TransformersConverter`` into ``<name>-ct2-int8``. llama.cpp runs the
GGUF file itself (an optional extra: ``pip install edge-rtgi[llamacpp]``).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_rtgi.bench.workloads import PreparedRequest
from edge_rtgi.errors import EdgeRtgiError

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

PEER_NAMES = ("hf-fp32", "hf-bf16", "ct2-int8", "llamacpp")
Pieces = Iterator[tuple[tuple[int, ...], str]]


class PeerUnavailable(EdgeRtgiError):
    """A peer cannot run here (package missing, conversion impossible); the benchmark skips it."""


def _decode_text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """An HF tokenizer's text for one flat list of ids (``decode`` is typed for batches too)."""
    text = tokenizer.decode(ids)
    if not isinstance(text, str):  # a flat id list always decodes to one string
        raise TypeError(f"tokenizer.decode gave a {type(text).__name__}, not a str")
    return text


def peer_cache_dir(model_name: str) -> Path:
    """Where a model's converted peer copies live; a path given as the model gets a flat name."""
    from edge_rtgi.catalog.cache import cache_dir

    return cache_dir() / "bench-peers" / model_name.strip("/").replace("/", "_")


def ensure_hf_folder(source: Path, model_name: str) -> Path:
    """An HF folder (config, safetensors, tokenizer) for ``source``: the folder itself when it
    is one, else dequantised from the GGUF file once and cached."""
    if source.is_dir():
        return source
    gguf_path = source
    folder = peer_cache_dir(model_name) / "hf"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise PeerUnavailable("transformers is not installed", hint="pip install edge-rtgi[bench]") from exc
    log.info("converting %s to an HF folder with transformers' GGUF loader (once)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype="float32")
    # The weights are already dequantised to fp32; only the "gguf" marker blocks saving.
    # transformers sets hf_quantizer dynamically; PreTrainedModel does not declare it
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name("hf.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def ensure_ct2_folder(hf_folder: Path, model_name: str) -> Path:
    """A CTranslate2 int8 model converted from ``hf_folder``, cached."""
    out = peer_cache_dir(model_name) / "ct2-int8"
    if (out / "model.bin").is_file():
        return out
    import ctranslate2

    tmp = out.with_name("ct2-int8.partial")
    ctranslate2.converters.TransformersConverter(str(hf_folder)).convert(
        str(tmp), quantization="int8", force=True
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


class HFPeer:
    """HF transformers ``generate`` with a token streamer. ``dtype``: "float32" or "bfloat16"."""

    def __init__(self, hf_folder: Path, dtype: str, attn: str | None, num_threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from edge_rtgi.device import resolve_device

        torch.set_num_threads(num_threads)
        self.device = resolve_device("auto")
        kwargs = {"attn_implementation": attn} if attn else {}
        model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=getattr(torch, dtype), **kwargs)
        # transformers wraps PreTrainedModel.to with functools.wraps, whose stub type does not bind self
        self.model: GenerationMixin | None = model.to(self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = AutoTokenizer.from_pretrained(hf_folder)
        self.name = f"HF transformers {'fp32' if dtype == 'float32' else 'bf16'}{' ' + attn if attn else ''}"

    def stream(self, request: PreparedRequest, cancel: threading.Event) -> Pieces:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        out: queue.SimpleQueue = queue.SimpleQueue()
        done = object()

        class Streamer(BaseStreamer):
            def __init__(self):
                self.prompt_seen = False

            def put(self, value):  # the first call carries the prompt, then one token per step
                if not self.prompt_seen:
                    self.prompt_seen = True
                    return
                out.put(tuple(int(t) for t in value.reshape(-1).tolist()))

            def end(self):
                out.put(done)

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), cancel.is_set(), dtype=torch.bool)

        model = self.model
        if model is None:
            raise RuntimeError(f"{self.name} is closed")
        ids = torch.tensor([list(request.prompt_token_ids)], device=self.device)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=request.max_tokens,
            do_sample=False,
            streamer=Streamer(),
            stopping_criteria=StoppingCriteriaList([Cancelled()]),
            attention_mask=torch.ones_like(ids),
            pad_token_id=self.tokenizer.pad_token_id or 0,
        )
        if request.ignore_eos:
            kwargs["min_new_tokens"] = request.max_tokens
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with torch.inference_mode():
                    model.generate(ids, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                errors.append(exc)
                out.put(done)

        thread = threading.Thread(target=run, name="hf-generate", daemon=True)
        thread.start()
        try:
            while (item := out.get()) is not done:
                yield item, _decode_text(self.tokenizer, list(item))
        finally:
            cancel.set()
            thread.join()
        if errors:
            raise errors[0]

    def close(self) -> None:
        self.model = None


class CT2Peer:
    """CTranslate2 ``Generator.generate_tokens`` on an int8 model."""

    def __init__(self, ct2_folder: Path, hf_folder: Path, num_threads: int):
        import ctranslate2
        from transformers import AutoTokenizer

        cuda = ctranslate2.get_cuda_device_count() > 0
        self.generator = ctranslate2.Generator(
            str(ct2_folder),
            device="cuda" if cuda else "cpu",
            compute_type="int8_float16" if cuda else "int8",
            intra_threads=num_threads,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(hf_folder)
        self.name = "CTranslate2 int8"

    def stream(self, request: PreparedRequest, cancel: threading.Event) -> Pieces:
        tokens = self.tokenizer.convert_ids_to_tokens(list(request.prompt_token_ids))
        kwargs: dict[str, Any] = dict(max_length=request.max_tokens, sampling_topk=1)
        if request.ignore_eos:
            kwargs["min_length"] = request.max_tokens
        for step in self.generator.generate_tokens(tokens, **kwargs):
            if cancel.is_set():
                return
            yield (int(step.token_id),), _decode_text(self.tokenizer, [step.token_id])

    def close(self) -> None:
        self.generator = None


_PROBE = """
import sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"Hello there", add_bos=False))
"""


def llamacpp_extra_buffers_work(gguf_path: Path) -> bool:
    """Whether llama.cpp's extra buffer types (AMX tiles, repacked weights) run here.

    A build for a CPU that advertises AMX uses AMX tile instructions, which raise SIGILL where
    the kernel does not grant AMX state (seen in sandboxed VMs). The failure kills the whole
    process, so it is probed in a child process first.
    """
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, str(gguf_path)], capture_output=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the GGUF file itself (Q4_1 for SmolLM2)."""

    def __init__(
        self, gguf_path: Path, num_threads: int, context_tokens: int = 2048, prompt_lookup_tokens: int = 0
    ):
        """``prompt_lookup_tokens`` > 0: llama-cpp-python's own speculative decoding with its
        prompt-lookup draft (``LlamaPromptLookupDecoding``) proposing up to that many tokens."""
        if gguf_path.suffix != ".gguf":
            raise PeerUnavailable(f"llama.cpp needs a GGUF file; the model is {gguf_path}")
        try:
            import llama_cpp
            import llama_cpp.llama_cpp as low_level
        except ImportError as exc:
            raise PeerUnavailable(
                "llama-cpp-python is not installed",
                hint="pip install 'edge-rtgi[llamacpp]' (builds llama.cpp from source, ~4 min)",
            ) from exc
        self.extra_buffers = llamacpp_extra_buffers_work(gguf_path)
        defaults = low_level.llama_model_default_params
        if not self.extra_buffers:
            log.warning("llama.cpp's extra buffer types crash on this machine (SIGILL); running without them")

            def without_extra_buffers():
                params = defaults()
                params.use_extra_bufts = False
                return params

            low_level.llama_model_default_params = without_extra_buffers
        draft = None
        if prompt_lookup_tokens:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup_tokens)
        try:
            # n_gpu_layers=-1 offloads everything when llama.cpp was built with CUDA; ignored otherwise
            self.llm = llama_cpp.Llama(
                draft_model=draft,
                model_path=str(gguf_path),
                n_ctx=context_tokens,
                n_threads=num_threads,
                n_threads_batch=num_threads,
                n_batch=512,
                n_gpu_layers=-1,
                verbose=False,
            )
        finally:
            low_level.llama_model_default_params = defaults
        self.eos = self.llm.token_eos()
        self.name = (
            f"llama.cpp {_gguf_type(gguf_path)} (llama-cpp-python {llama_cpp.__version__}"
            f"{'' if self.extra_buffers else ', no extra buffer types'})"
            + (f", prompt lookup {prompt_lookup_tokens}" if prompt_lookup_tokens else "")
        )

    def reset(self) -> None:
        """Forget cached prompt state so the next request starts cold."""
        self.llm.reset()

    def stream(self, request: PreparedRequest, cancel: threading.Event) -> Pieces:
        produced = 0
        for token in self.llm.generate(
            list(request.prompt_token_ids), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            if cancel.is_set():
                return
            produced += 1
            yield (int(token),), self.llm.detokenize([token]).decode("utf-8", errors="ignore")
            if produced >= request.max_tokens or (token == self.eos and not request.ignore_eos):
                return

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)  # the model's memory goes with the last reference
        if llm is not None and hasattr(llm, "close"):
            llm.close()


def _gguf_type(path: Path) -> str:
    stem = path.stem
    return stem.rsplit(".", 1)[-1] if "." in stem else "gguf"


def build_peer(name: str, gguf_path: Path, model_name: str, num_threads: int) -> Any:
    """Instantiate a peer by name; raises PeerUnavailable when it cannot run here."""
    if name not in PEER_NAMES:
        raise EdgeRtgiError(f"unknown peer {name!r}", hint=f"choose from {', '.join(PEER_NAMES)}")
    if name == "llamacpp":
        return LlamaCppPeer(gguf_path, num_threads)
    hf = ensure_hf_folder(gguf_path, model_name)
    if name == "hf-fp32":
        return HFPeer(hf, "float32", "eager", num_threads)
    if name == "hf-bf16":
        return HFPeer(hf, "bfloat16", None, num_threads)
    # CTranslate2's MKL int8 GEMM gives garbage on this class of AVX-512 CPU (checked against the
    # fp32 model); its oneDNN/ruy path is correct. Must be set before the library is first loaded.
    os.environ.setdefault("CT2_USE_MKL", "0")
    try:
        import ctranslate2  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable("ctranslate2 is not installed", hint="it comes with faster-whisper") from exc
    return CT2Peer(ensure_ct2_folder(hf, model_name), hf, num_threads)
