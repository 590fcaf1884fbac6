"""Drafters of every config schema z-lab publishes: they load, export what they read, compute what
the published implementations compute, and stay lossless in the loop and through the CLI.

The checkpoints are written here by hand in z-lab's format (``config.json`` + safetensors with
z-lab's parameter names), one per schema:

* classic: DFlash fields at the top level (``block_size``) and in ``dflash_config``;
  ``rope_theta`` / ``rope_scaling``; ``auto_map`` to remote code;
* nested: ``dflash_config.block_size`` only, ``rope_parameters``;
* sliding: ``layer_types`` with ``sliding_attention`` layers and ``sliding_window`` (no causal
  declaration: such layers are causal, as vLLM and SGLang run them);
* causal-flag: the same with ``dflash_config.causal = true``; is-causal: top-level ``is_causal``
  (true: every layer causal; false: sliding layers that attend both ways, DFlash2-fixture style);
* attention-bias: ``attention_bias = true`` (biases on q/k/v/o);
* yarn: gpt-oss-style yarn RoPE (``rope_scaling`` with ``rope_type = yarn`` and ``truncate``).

The semantics test compares our drafter with a plain, slow attention written below from the
published behaviour (which positions a layer sees, whether the block attends causally), not
from ``drafter.py``; the yarn schema is compared with transformers' own DFlash assistant model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_core import cli
from dflash_core.drafter import DFlashDrafter
from dflash_core.drafter_config import LayerAttention
from dflash_core.errors import ModelLoadError
from dflash_core.speculative import GenerationConfig, collect, stream
from dflash_core.target import FastTarget, HFTarget
from dflash_core.testing import tiny_chat_tokenizer, tiny_target

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 64, 4, 2, 16, 96, 96
TARGET_LAYER_IDS = [1, 2]
WINDOW = 6  # small, so that contexts of a few dozen tokens run past it


def base_config(layers: int = 2) -> dict:
    """What every schema shares: a z-lab DFlashDraftModel config for the tiny 64-wide targets."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "num_target_layers": 4,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
    }


def schema_config(schema: str) -> dict:
    raw = base_config()
    dflash = {"mask_token_id": 3, "target_layer_ids": TARGET_LAYER_IDS}
    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW,
               "use_sliding_window": True, "max_window_layers": 1}
    if schema == "classic":
        raw.update(block_size=16, rope_theta=10000.0, rope_scaling=None)
    elif schema == "nested":
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        dflash["block_size"] = 16
    elif schema == "sliding":
        raw.update(block_size=16, rope_theta=10000.0, **sliding)
    elif schema == "causal-flag":
        raw.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **sliding)
        dflash.update(block_size=16, causal=True)
    elif schema == "is-causal":
        raw.update(block_size=16, rope_theta=10000.0, is_causal=True, **sliding)
    elif schema == "non-causal-sliding":
        raw.update(block_size=16, rope_theta=10000.0, is_causal=False,
                   layer_types=["sliding_attention"] * 2, sliding_window=WINDOW, use_sliding_window=True)
    elif schema == "attention-bias":
        raw.update(block_size=16, rope_theta=10000.0, attention_bias=True)
    elif schema == "yarn":
        raw.update(block_size=16, rope_theta=150000.0, max_position_embeddings=131072,
                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 4096, "truncate": False})
    else:
        raise ValueError(schema)
    raw["dflash_config"] = dflash
    return raw


SCHEMAS = ["classic", "nested", "sliding", "causal-flag", "is-causal", "non-causal-sliding", "attention-bias", "yarn"]
# What each schema's layers must do (LayerAttention per layer).
EXPECTED_LAYERS = {
    "classic": [LayerAttention(), LayerAttention()],
    "nested": [LayerAttention(), LayerAttention()],
    "sliding": [LayerAttention(WINDOW, True), LayerAttention(None, False)],
    "causal-flag": [LayerAttention(WINDOW, True), LayerAttention(None, True)],
    "is-causal": [LayerAttention(WINDOW, True), LayerAttention(None, True)],
    "non-causal-sliding": [LayerAttention(WINDOW, False), LayerAttention(WINDOW, False)],
    "attention-bias": [LayerAttention(), LayerAttention()],
    "yarn": [LayerAttention(), LayerAttention()],
}


def checkpoint_tensors(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under z-lab's parameter names, shaped by the config alone."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = raw["hidden_size"], raw["intermediate_size"]
    heads, kv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    ids = (raw.get("dflash_config") or {}).get("target_layer_ids") or raw["target_layer_ids"]

    def w(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + w(dim, std=0.1)

    out = {"fc.weight": w(hidden, len(ids) * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(raw["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv * hd, hidden),
            p + "self_attn.v_proj.weight": w(kv * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
        })
        if raw.get("attention_bias"):
            out.update({p + "self_attn.q_proj.bias": w(heads * hd), p + "self_attn.k_proj.bias": w(kv * hd),
                        p + "self_attn.v_proj.bias": w(kv * hd), p + "self_attn.o_proj.bias": w(hidden)})
    return out


def write_checkpoint(directory: Path, raw: dict, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(checkpoint_tensors(raw, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


# ------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("schema", SCHEMAS)
def test_a_drafter_of_every_schema_loads(tmp_path, schema):
    raw = schema_config(schema)
    write_checkpoint(tmp_path, raw)
    drafter = DFlashDrafter.from_pretrained(tmp_path)
    assert drafter.block_size == 16 and drafter.mask_token_id == 3 and drafter.target_layer_ids == TARGET_LAYER_IDS
    assert drafter.layer_specs == EXPECTED_LAYERS[schema]
    weights = load_file(str(tmp_path / "model.safetensors"))
    state = drafter.state_dict()
    assert set(state) == set(weights)
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    rope = drafter.config.qwen3.rope_parameters
    if schema == "yarn":
        assert rope["rope_type"] == "yarn" and rope["factor"] == 32.0 and rope["rope_theta"] == 150000.0
        assert drafter.rotary.scaling != 1.0  # yarn's attention factor reaches cos/sin
    elif schema == "nested":
        assert rope == {"rope_type": "default", "rope_theta": 1000000.0}
    with torch.no_grad():
        hidden = drafter(torch.randn(1, 16, HIDDEN), torch.arange(30, 46), torch.randn(1, 30, 2 * HIDDEN), torch.arange(30))
    assert hidden.shape == (1, 16, HIDDEN) and torch.isfinite(hidden).all()


READ_BUT_NOT_EXPORTED = {"auto_map"}  # names remote code (dflash.py) that an export does not ship


@pytest.mark.parametrize("schema", SCHEMAS)
def test_export_keeps_every_field_it_read(tmp_path, schema):
    from dflash_core.training.export import export_drafter

    raw = schema_config(schema)
    drafter = DFlashDrafter.from_pretrained(write_checkpoint(tmp_path / "in", raw))
    export_drafter(drafter, tmp_path / "out", {"target": "tiny"})
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    for key, value in raw.items():
        if key in READ_BUT_NOT_EXPORTED:
            continue
        assert key in out, key
        if key == "dflash_config":
            assert {k: out[key].get(k) for k in value} == value
        elif key == "rope_scaling" and value is not None:
            assert {k: out[key].get(k) for k in value} == value
        else:
            assert out[key] == value, (key, out[key], value)
    again = DFlashDrafter.from_pretrained(tmp_path / "out")
    assert again.layer_specs == drafter.layer_specs
    assert again.config.qwen3.rope_parameters == drafter.config.qwen3.rope_parameters
    noise, ctx = torch.randn(1, 16, HIDDEN), torch.randn(1, 20, 2 * HIDDEN)
    with torch.no_grad():
        a = drafter.to(torch.bfloat16)(noise.bfloat16(), torch.arange(20, 36), ctx.bfloat16(), torch.arange(20))
        b = again.to(torch.bfloat16)(noise.bfloat16(), torch.arange(20, 36), ctx.bfloat16(), torch.arange(20))
    assert torch.equal(a, b)


def dflash2_config() -> dict:
    """The shape of z-lab's published DFlash2 config (grouped convolution + candidate selector)."""
    raw = base_config()
    raw.update(architectures=["DFlash2DraftModel"], is_causal=False, layer_types=["sliding_attention"] * 2,
               sliding_window=2048, use_sliding_window=True)
    raw["dflash_config"] = {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 3,
                            "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": TARGET_LAYER_IDS}
    return raw


@pytest.mark.parametrize("change, message", [
    (lambda raw: dflash2_config(), r"DFlash2 drafter \(conv_kernel_size=2, conv_group_size=16, selector_rank=256, "
                                   r"selector_top_k=16\).*grouped convolution.*candidate selector"),
    (lambda raw: {**raw, "dflash_config": {**raw["dflash_config"], "conv_kernel_size": 2, "conv_group_size": 4}},
     "DFlash2 drafter"),
    (lambda raw: {**raw, "dflash_config": {**raw["dflash_config"], "attention_sink_bias": True}}, "attention_sink_bias"),
    (lambda raw: {**raw, "dflash_config": {**raw["dflash_config"], "projector_type": "domino"}}, "projector_type"),
    (lambda raw: {**raw, "layer_types": ["sliding_attention", "full_attention"]}, "need sliding_window"),
    (lambda raw: {**raw, "layer_types": ["linear_attention", "full_attention"]}, "not drafter layers"),
    (lambda raw: {**raw, "is_causal": "yes"}, "is_causal = 'yes'"),
    (lambda raw: {**raw, "draft_vocab_size": 32}, "draft_vocab_size"),
])
def test_what_a_drafter_cannot_do_is_refused_by_name(tmp_path, change, message):
    raw = change(schema_config("classic"))
    write_checkpoint(tmp_path, raw)
    with pytest.raises(ModelLoadError, match=message):
        DFlashDrafter.from_pretrained(tmp_path)


# ---------------------------------------------------------------- the published semantics, by hand
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Default (neox-style) RoPE: pairs (i, i + D/2) turn by position * theta^(-2i/D)."""
    d = x.shape[-1]
    angle = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)[None]
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]  # (T, 1, D/2), shared by heads
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def reference_hidden(weights: dict, raw: dict, noise, block_pos, ctx_features, ctx_pos) -> torch.Tensor:
    """The drafter's final hidden states for one block, straight from the description: the block
    (anchor + masks) queries; keys/values are the fused context then the block; a sliding layer's
    query at position p sees only keys within WINDOW positions of p (itself included); a causal
    layer's slot i sees block slots 0..i (the context lies before every slot). One query, one
    head, one key at a time, in float64."""
    w = {k: v.double() for k, v in weights.items()}
    heads, kv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    layer_types = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
    declared = raw.get("is_causal", (raw.get("dflash_config") or {}).get("causal"))
    context = _rms(ctx_features.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = noise.double()
    q_len, c_len = x.shape[0], context.shape[0]
    key_pos = torch.cat((ctx_pos, block_pos)).tolist()
    for layer, kind in enumerate(layer_types):
        p = f"layers.{layer}."

        def proj(name, h):
            out = h @ w[p + f"self_attn.{name}.weight"].T
            return out + w[p + f"self_attn.{name}.bias"] if p + f"self_attn.{name}.bias" in w else out

        sliding = kind == "sliding_attention"
        causal = declared if declared is not None else sliding
        h = _rms(x, w[p + "input_layernorm.weight"])
        source = torch.cat((context, h))
        q = _rotate(_rms(proj("q_proj", h).view(q_len, heads, hd), w[p + "self_attn.q_norm.weight"]), block_pos, theta)
        k = _rotate(_rms(proj("k_proj", source).view(-1, kv, hd), w[p + "self_attn.k_norm.weight"]),
                    torch.cat((ctx_pos, block_pos)), theta)
        v = proj("v_proj", source).view(-1, kv, hd)
        attended = torch.zeros(q_len, heads, hd, dtype=torch.float64)
        for i in range(q_len):
            for head in range(heads):
                group = head // (heads // kv)
                keys = []
                for j in range(c_len + q_len):
                    if sliding and abs(int(block_pos[i]) - key_pos[j]) >= WINDOW:
                        continue
                    if causal and j >= c_len and j - c_len > i:  # a later slot of the block
                        continue
                    keys.append(j)
                scores = torch.stack([q[i, head] @ k[j, group] / math.sqrt(hd) for j in keys])
                probs = torch.softmax(scores, 0)
                attended[i, head] = sum(prob * v[j, group] for prob, j in zip(probs, keys))
        x = x + proj("o_proj", attended.reshape(q_len, heads * hd))
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"])


@pytest.mark.parametrize("schema", ["sliding", "causal-flag", "is-causal", "non-causal-sliding", "attention-bias", "nested"])
def test_drafts_equal_a_plain_reference_of_the_published_semantics(tmp_path, schema):
    raw = schema_config(schema)
    write_checkpoint(tmp_path, raw, seed=3)
    weights = load_file(str(tmp_path / "model.safetensors"))
    drafter = DFlashDrafter.from_pretrained(tmp_path, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    features = torch.randn(40, 2 * HIDDEN, generator=gen, dtype=torch.float64)
    block = 8
    # A context fed in cycles, as the loop feeds it (the first one far longer than the window,
    # then the accepted tokens of each cycle), each cycle drafting from the context so far.
    cache = drafter.new_cache()
    fed = 0
    for total in (21, 22, 27, 28, 36, 40):
        noise = torch.randn(block, HIDDEN, generator=gen, dtype=torch.float64)
        block_pos = torch.arange(total, total + block)
        with torch.no_grad():
            ours = drafter(noise[None], block_pos, features[None, fed:total], torch.arange(fed, total), cache=cache)[0]
            one_shot = drafter(noise[None], block_pos, features[None, :total], torch.arange(total))[0]
        want = reference_hidden(weights, raw, noise, block_pos, features[:total], torch.arange(total))
        assert torch.allclose(ours, want, atol=1e-5), (schema, total)  # our norms compute in fp32
        assert torch.allclose(one_shot, want, atol=1e-5), (schema, total)
        assert torch.equal((ours @ head.T).argmax(-1), (want @ head.T).argmax(-1))  # the proposals
        fed = total
    assert cache.length == 40
    if any(spec.sliding_window for spec in drafter.layer_specs):
        # The sliding layer keeps only what its window can still reach: the window minus one.
        layer = next(i for i, spec in enumerate(drafter.layer_specs) if spec.sliding_window)
        assert cache.positions[layer].tolist() == list(range(40 - WINDOW + 1, 40))
    # And the semantics have teeth: the same weights read as full, non-causal layers differ.
    if not all(spec.plain for spec in drafter.layer_specs):
        plain = {k: v for k, v in raw.items() if k not in ("layer_types", "is_causal", "sliding_window")}
        plain["dflash_config"] = {k: v for k, v in raw["dflash_config"].items() if k != "causal"}
        noise = torch.randn(block, HIDDEN, generator=gen, dtype=torch.float64)
        full = reference_hidden(weights, plain, noise, torch.arange(40, 48), features, torch.arange(40))
        with torch.no_grad():
            ours = drafter(noise[None], torch.arange(40, 48), features[None], torch.arange(40))[0]
        assert not torch.allclose(ours, full, atol=1e-3)


def test_yarn_rope_matches_transformers_own_dflash_assistant(tmp_path):
    """gpt-oss drafters' yarn RoPE: the same numbers as transformers' MuseGlimmerAssistantModel
    (z-lab's architecture under other parameter names) with the same weights."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    raw = schema_config("yarn")
    write_checkpoint(tmp_path, raw, seed=5)
    weights = load_file(str(tmp_path / "model.safetensors"))
    ours = DFlashDrafter.from_pretrained(tmp_path)
    config = MuseGlimmerAssistantConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, max_position_embeddings=131072,
        rope_parameters={**raw["rope_scaling"], "rope_theta": raw["rope_theta"]},
        layer_types=["full_attention"] * 2, block_size=16, mask_token_id=3, target_layer_ids=TARGET_LAYER_IDS,
        vocab_size=VOCAB,
    )
    theirs = MuseGlimmerAssistantModel(config).eval()
    renamed = {k.replace("fc.", "encoder.fc.").replace("hidden_norm.", "encoder.output_norm_enc."): v
               for k, v in weights.items()}
    theirs.load_state_dict(renamed)
    gen = torch.Generator().manual_seed(2)
    noise, ctx = torch.randn(1, 16, HIDDEN, generator=gen), torch.randn(1, 3000, 2 * HIDDEN, generator=gen)
    with torch.no_grad():
        mine = ours(noise, torch.arange(3000, 3016), ctx, torch.arange(3000))
        ref = theirs(noise_embeds=noise, context_hidden_states=ctx, position_ids=torch.arange(3016)[None]).last_hidden_state
    assert torch.allclose(mine, ref, atol=1e-4)


@pytest.mark.parametrize("schema", ["sliding", "causal-flag", "non-causal-sliding"])
def test_the_training_layout_applies_the_same_windows_and_causality(schema):
    """The block-wise training attention equals the dense mask for sliding and causal layers."""
    from dflash_core.drafter import BlockLayout
    from dflash_core.drafter_config import DrafterConfig
    from dflash_core.training.objective import make_batch

    drafter = DFlashDrafter(DrafterConfig.from_dict(schema_config(schema)))
    drafter.load_state_dict(checkpoint_tensors(schema_config(schema)))
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(4, 96, (n,), generator=gen), torch.randn(n, 2 * HIDDEN, generator=gen), 5) for n in (30, 41)]
    batch = make_batch(seqs, 4, 8, mask_token_id=3, generator=gen)
    noise = torch.randn(*batch.block_ids.shape, HIDDEN, generator=gen)
    with torch.no_grad():
        dense = drafter(noise, batch.block_pos, batch.context, batch.context_pos, mask=batch.mask())
        fast = drafter(noise, batch.block_pos, batch.context, batch.context_pos, mask=BlockLayout(batch.anchors, 8))
    assert torch.allclose(dense, fast, atol=1e-5)


# ---------------------------------------------------------------- lossless in the loop and the CLI
PROMPTS = [[5, 17, 42, 8, 9, 60, 11, 23], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 30, 31]]


@pytest.fixture(scope="module")
def targets():
    """One runner per family (our fast forward for Llama, transformers' for Qwen3) and its greedy
    autoregressive answers, shared by every schema."""
    out = {}
    for family, runner_cls in (("llama", FastTarget), ("qwen3", HFTarget)):
        runner = runner_cls(tiny_target(family))
        answers = [collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=40, block_size=1).validated(16)))
                   for prompt in PROMPTS]
        out[family] = (runner, answers)
    return out


@pytest.mark.parametrize("schema", SCHEMAS)
def test_greedy_dflash_equals_greedy_ar_with_every_schema(tmp_path, targets, schema):
    drafter = DFlashDrafter.from_pretrained(write_checkpoint(tmp_path, schema_config(schema)))
    for family, (runner, answers) in targets.items():
        for prompt, ar in zip(PROMPTS, answers):
            for block in (4, 16):
                out = collect(stream(runner, drafter, prompt, GenerationConfig(max_new_tokens=40, block_size=block).validated(16)))
                assert out.token_ids == ar.token_ids, (schema, family, block)
                # A random drafter: most cycles reject a draft, so the caches roll back again and again.
                rejected = [c for c in out.cycles if c.num_accepted < len(c.drafted)]
                assert len(rejected) >= len(out.cycles) // 2


def tiny_target_dir(directory: Path, family: str) -> Path:
    """A tiny random target saved with a tokenizer of 96 ids and a chat template."""
    model = tiny_target(family)
    model.save_pretrained(directory)
    tiny_chat_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("schema", ["sliding", "causal-flag", "yarn"])
def test_cli_greedy_dflash_equals_ar_with_z_lab_format_drafters(tmp_path, capsys, schema):
    write_checkpoint(tmp_path / "drafter", schema_config(schema))
    for family in ("llama", "qwen3"):
        tiny_target_dir(tmp_path / family, family)
    registry = tmp_path / "models.toml"
    registry.write_text("".join(
        f'[pairs.{family}]\ntarget = {{ path = "{family}" }}\ndrafter = {{ path = "drafter" }}\ndtype = "float32"\n'
        f'engine = "{engine}"\n\n'
        for family, engine in (("llama", "auto"), ("qwen3", "hf"))
    ))
    for family in ("llama", "qwen3"):
        runs = {}
        for mode in ("dflash", "ar"):
            assert cli.main(["--registry", str(registry), "generate", "--pair", family, "--json", "--mode", mode,
                             "--prompt", "count to ten", "--max-new-tokens", "48"]) == 0
            runs[mode] = json.loads(capsys.readouterr().out)
        assert runs["dflash"]["token_ids"] == runs["ar"]["token_ids"], (schema, family)
        assert runs["dflash"]["num_tokens"] >= 1 and runs["dflash"]["cycles"]
